import sys

# Guarded: engine processes start with the spawn method, which re-imports this module in the child.
if __name__ == "__main__":
    from app.bootstrap.preflight import reexec_early

    reexec_early(sys.argv[1:])  # `serve` preloads its libraries before anything heavy loads (may not return)
    from app.cli import main

    sys.exit(main())
