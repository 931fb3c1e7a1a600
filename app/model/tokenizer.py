"""The model's tokenizer, and a torch-free copy of it for the HTTP frontend.

transformers reads a GGUF file's tokenizer (and converts slow tokenizers) through code that imports
torch: hundreds of MiB in every frontend worker, which only tokenizes. So the bootstrap exports the
tokenizer once, in a short-lived process (`python -m app.model.tokenizer`), as a fast tokenizer in
the private runtime directory, and each worker loads that with the `tokenizers` backend alone.
"""

from __future__ import annotations

import sys
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
    tokenizer = load_tokenizer(source)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"the tokenizer of {source.path} has no fast (tokenizers) version to export")
    tokenizer.save_pretrained(str(directory))


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
