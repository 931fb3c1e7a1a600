"""What the appliance keeps across starts: `$APPLIANCE_CACHE_DIR`, default `~/.cache/llm-appliance`.

Each kind of entry has its own folder (`tokenizers/`: the frontend's tokenizer exports; `calibration/`: the
engine's fitted step costs). An entry is named by a hash of everything it depends on, so a changed input
makes a new entry and never reads an old one. Entries are written under a private name and renamed into
place; a cache that cannot be read or written is skipped, never an error: everything in it can be rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path


def cache_dir(kind: str) -> Path | None:
    """The folder of `kind`'s entries (not created here); None where there is no cache (no home directory)."""
    root = os.environ.get("APPLIANCE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "llm-appliance")
    if root.startswith("~"):
        return None
    return Path(root) / kind


def entry_name(key: str | dict) -> str:
    """An entry's name: a hash of its key (a dict is hashed as canonical JSON)."""
    text = key if isinstance(key, str) else json.dumps(key, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def write_text(path: Path, text: str) -> bool:
    """Write `path` whole or not at all (a reader never sees half of it); False where it cannot be written."""
    temporary = path.parent / f".{path.name}.{os.getpid()}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(text)
        os.replace(temporary, path)
        return True
    except OSError:
        with contextlib.suppress(OSError):  # (its folder may not exist either)
            temporary.unlink(missing_ok=True)
        return False
