"""The model's tokenizer, and a torch-free copy of it for the HTTP frontend.

transformers reads a GGUF file's tokenizer (and converts slow tokenizers) through code that imports
torch: hundreds of MiB in every frontend worker, which only tokenizes. So the bootstrap exports the
tokenizer once, in a short-lived process (`python -m app.model.tokenizer`), as a fast tokenizer in
the private runtime directory, and each worker loads that with the `tokenizers` backend alone.

Converting a GGUF file's tokenizer takes seconds (about 9 s for SmolLM2 on 2 vCPUs, competing with
the engine's start), so the export is kept in a cache (`$APPLIANCE_CACHE_DIR`, default
`~/.cache/llm-appliance`) keyed by the model file's path, size and mtime and the transformers and
tokenizers versions: later starts copy it. A cache that cannot be written is skipped, not an error.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

from app.model.source import ModelSource


def load_tokenizer(source: ModelSource):
    """The tokenizer of a GGUF file or a Hugging Face directory (imports torch through transformers)."""
    from transformers import AutoTokenizer

    if source.format == "gguf":
        return AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    return AutoTokenizer.from_pretrained(str(source.path))


def export_tokenizer(source: ModelSource, directory: Path) -> None:
    """Write the tokenizer as a fast tokenizer (tokenizer.json, its config and chat template) to `directory`."""
    cached = cache_entry(source)
    if cached is not None and (cached / "tokenizer.json").is_file():
        shutil.copytree(cached, directory, dirs_exist_ok=True)
        return
    tokenizer = load_tokenizer(source)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"the tokenizer of {source.path} has no fast (tokenizers) version to export")
    tokenizer.save_pretrained(str(directory))
    if cached is not None:
        _store(Path(directory), cached)


def cache_entry(source: ModelSource) -> Path | None:
    """Where the export of `source`'s tokenizer is cached (None: no cache, e.g. no home directory)."""
    root = os.environ.get("APPLIANCE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "llm-appliance")
    if root.startswith("~"):
        return None
    try:
        stat = source.path.stat()
        key = f"{source.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{version('transformers')}:{version('tokenizers')}"
    except OSError:
        return None
    return Path(root) / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:32]


def _store(exported: Path, entry: Path) -> None:
    """Copy an export into the cache: into a private temporary name first, then renamed into place."""
    temporary = entry.parent / f".{entry.name}.{os.getpid()}"
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(exported, temporary)
        os.rename(temporary, entry)  # atomic; another process may have stored it first: keep theirs
    except OSError:
        shutil.rmtree(temporary, ignore_errors=True)


def load_exported(directory: str | Path):
    """A tokenizer that `export_tokenizer` wrote; does not import torch."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(directory))


def main(argv: list[str]) -> int:
    path, fmt, name, out = argv
    export_tokenizer(ModelSource(Path(path), fmt, name), Path(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
