import sys

from app.cli import main

# Guarded: engine processes start with the spawn method, which re-imports this module in the child.
if __name__ == "__main__":
    sys.exit(main())
