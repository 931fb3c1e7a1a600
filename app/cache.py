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
import tempfile
from pathlib import Path


def cache_root() -> Path | None:
    """The cache's folder (not created here), from the environment; None where there is none (no home directory).
    Read where a start reads its environment (the bootstrap, the offline LLM): engines are handed it."""
    root = os.environ.get("APPLIANCE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "llm-appliance")
    return None if root.startswith("~") else Path(root)


def cache_dir(kind: str) -> Path | None:
    """The folder of `kind`'s entries (not created here); None where there is no cache."""
    root = cache_root()
    return None if root is None else root / kind


def entry_name(key: str | dict) -> str:
    """An entry's name: a hash of its key (a dict is hashed as canonical JSON)."""
    text = key if isinstance(key, str) else json.dumps(key, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def write_text(path: Path, text: str) -> bool:
    """Write `path` whole or not at all (a reader never sees half of it); False where it cannot be written."""
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a name no other writer has (processes of two containers sharing the folder may have the same pid)
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(temporary, path)
        return True
    except OSError:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        return False
