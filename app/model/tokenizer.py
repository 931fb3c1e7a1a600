"""The model's tokenizer, and a torch-free copy of it for the HTTP frontend.

transformers reads a GGUF file's tokenizer (and converts slow tokenizers) through code that imports
torch: hundreds of MiB in every frontend worker, which only tokenizes. So the bootstrap exports the
tokenizer once, in a short-lived process (`python -m app.model.tokenizer`), as a fast tokenizer in
the private runtime directory, and each worker loads that with the `tokenizers` backend alone. Where
the cache below has it, the bootstrap copies it itself (`copy_cached_export`), with no process.

A GGUF file's tokenizer is built by the class `AutoTokenizer` would pick, called directly:
`AutoTokenizer` first parses the whole file's metadata to learn the model type, which our own header
reader tells in milliseconds. Neither that choice nor the build imports torch (`_build_without_torch`):
a first start's export takes about 1.4 s on a 2-core Xeon, against 3.0 s with torch imported, and the
engine loads beside it on the same cores. The export is kept in a cache (`$APPLIANCE_CACHE_DIR`,
default `~/.cache/llm-appliance`) keyed by the model file's path, size and mtime and the transformers
and tokenizers versions: later starts copy it. A cache that cannot be written is skipped, not an error.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
import types
from importlib.metadata import version
from pathlib import Path

from app.cache import cache_dir, entry_name
from app.model.source import ModelSource

log = logging.getLogger(__name__)


def load_tokenizer(source: ModelSource):
    """The tokenizer of a GGUF file or a Hugging Face directory (through `AutoTokenizer`, which imports torch,
    except for the GGUF files of the architectures we run)."""
    if source.format == "gguf":
        chosen = gguf_tokenizer_class(source.path)
        if chosen is not None:
            built = _build_without_torch(chosen, source.path) if "torch" not in sys.modules else None
            return built if built is not None else chosen.from_pretrained(str(source.path.parent),
                                                                          gguf_file=source.path.name)
    from transformers import AutoTokenizer

    if source.format == "gguf":
        return AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    return AutoTokenizer.from_pretrained(str(source.path))


# The class `AutoTokenizer` takes for each GGUF architecture we run (its TOKENIZER_MAPPING_NAMES; None:
# TokenizersBackend), named here because importing that table imports torch through transformers'
# configuration classes. tests/model/test_tokenizer_cache.py checks that the two agree.
GGUF_TOKENIZER_CLASSES = {"llama": "TokenizersBackend", "qwen2": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer",
                          "qwen3moe": "Qwen2Tokenizer"}


def gguf_tokenizer_class(path: Path):
    """The tokenizer class `AutoTokenizer` picks for a GGUF file of an architecture we run, or None
    where its choice can depend on more than the file (then `AutoTokenizer` itself decides).

    Given a GGUF file, `AutoTokenizer` builds the model's config from the file alone, and a
    `tokenizer_config.json` beside it (or Mistral's `tekken.json`) is the only other thing it reads
    to choose. Without them it takes the class transformers registers for the file's model type
    (Qwen2Tokenizer for qwen2/qwen3) and `TokenizersBackend` where none is registered (llama, and
    "mistral", which transformers makes of a llama file whose general.name is "mistral").
    tests/model/test_tokenizer_cache.py checks that both give byte-identical exports."""
    import transformers

    from app.model.gguf_header import read_gguf_header

    if any((path.parent / name).exists() for name in ("tokenizer_config.json", "tekken.json")):
        return None
    name = GGUF_TOKENIZER_CLASSES.get(read_gguf_header(path).metadata.get("general.architecture"))
    return getattr(transformers, name, None) if name else None  # None: a transformers without it decides itself


READER_MODULE = "transformers.integrations.gguf.reader"


def _build_without_torch(chosen, path: Path):
    """`chosen.from_pretrained` on a GGUF file without importing torch, or None if that failed.

    transformers builds a GGUF file's tokenizer from the metadata that `integrations.gguf.reader` reads, a
    module that imports torch for its other work (loading tensors): 1-2 s and ~200 MiB of an export that
    needs none of it. While the tokenizer is built, our own reader stands in for that module; it returns the
    same metadata (tests/unit/test_model_info.py compares them). Should a transformers release use the
    module otherwise, the build fails here and the caller builds the tokenizer the usual way."""
    from app.model.gguf_header import read_gguf_metadata

    def metadata_and_no_tensor_names(gguf_path, string_arrays=()):
        return read_gguf_metadata(gguf_path, string_arrays), ()

    stand_in = types.ModuleType(READER_MODULE, "app.model.gguf_header's reader, standing in while a tokenizer is built")
    stand_in.read_gguf_metadata = metadata_and_no_tensor_names
    saved = sys.modules.get(READER_MODULE)
    sys.modules[READER_MODULE] = stand_in
    try:
        return chosen.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001 (the usual way, next, raises what is really wrong, if anything)
        log.warning("building the tokenizer of %s without torch failed (%s: %s); building it with transformers' "
                    "own GGUF reader", path, type(exc).__name__, exc)
        return None
    finally:
        if saved is None:
            sys.modules.pop(READER_MODULE, None)
        else:
            sys.modules[READER_MODULE] = saved


def export_tokenizer(source: ModelSource, directory: Path, use_cache: bool = True) -> bool:
    """Write the tokenizer as a fast tokenizer (tokenizer.json, its config and chat template) to `directory`.
    True where it was copied from the cache, False where it was converted from the model (and then cached;
    `use_cache=False` converts even where an entry exists, and replaces it)."""
    cached = cache_entry(source)
    if use_cache and _complete(cached):
        shutil.copytree(cached, directory, dirs_exist_ok=True)
        return True
    tokenizer = load_tokenizer(source)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"the tokenizer of {source.path} has no fast (tokenizers) version to export")
    tokenizer.save_pretrained(str(directory))
    if cached is not None:
        if not use_cache:
            shutil.rmtree(cached, ignore_errors=True)
        _store(Path(directory), cached)
    return False


def tokenizer_json(source: ModelSource) -> str:
    """The model's tokenizer as tokenizer.json text (structured outputs build their token masks from it): the
    cached export where there is one (the bootstrap makes it before the engine starts), else converted now."""
    cached = cache_entry(source)
    if _complete(cached):
        try:
            return (cached / "tokenizer.json").read_text(encoding="utf-8")
        except OSError:  # replaced meanwhile (an export with use_cache=False): convert below
            pass
    with tempfile.TemporaryDirectory(prefix="appliance-tokenizer-") as directory:
        export_tokenizer(source, Path(directory))
        return (Path(directory) / "tokenizer.json").read_text(encoding="utf-8")


def cached_export(source: ModelSource) -> tuple[str, int | None] | None:
    """The cached export's tokenizer.json text and its EOS token id (tokenizer_config.json's `eos_token`, as
    transformers reads it), without converting anything: None where the cache has no export of `source`."""
    import json

    entry = cache_entry(source)
    if not _complete(entry):
        return None
    try:
        text = (entry / "tokenizer.json").read_text(encoding="utf-8")
        config = json.loads((entry / "tokenizer_config.json").read_text(encoding="utf-8"))
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if not isinstance(eos, str):
            return text, None
        spec = json.loads(text)
        added = {t.get("content"): t.get("id") for t in spec.get("added_tokens") or ()}
        vocab = (spec.get("model") or {}).get("vocab")  # a dict in BPE and WordPiece models, a list in Unigram
        eos_id = added.get(eos, vocab.get(eos) if isinstance(vocab, dict) else None)
        return text, eos_id if isinstance(eos_id, int) else None
    except (OSError, ValueError, AttributeError, TypeError):  # replaced meanwhile, or not what an export writes
        return None


def cache_entry(source: ModelSource) -> Path | None:
    """Where the export of `source`'s tokenizer is cached (None: no cache, e.g. no home directory)."""
    folder = cache_dir("tokenizers")
    if folder is None:
        return None
    try:
        stat = source.path.stat()
        key = f"{source.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{version('transformers')}:{version('tokenizers')}"
    except OSError:
        return None
    return folder / entry_name(key)


def _complete(entry: Path | None) -> bool:
    """Whether a cache entry holds an export (entries appear whole: `_store`)."""
    return entry is not None and (entry / "tokenizer.json").is_file()


def _store(exported: Path, entry: Path) -> None:
    """Copy an export into the cache: into a private temporary name first, then renamed into place."""
    temporary = entry.parent / f".{entry.name}.{os.getpid()}"
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(exported, temporary)
        os.rename(temporary, entry)  # atomic; another process may have stored it first: keep theirs
    except OSError:
        shutil.rmtree(temporary, ignore_errors=True)


# End-of-turn markers of chat formats (Llama 3's <|eot_id|> and, after a built-in tool's call, <|eom_id|>;
# ChatML's <|im_end|>, Phi-3's <|end|>, Gemma's <end_of_turn>): where one is a special token of the tokenizer, it
# ends a generation as EOS does, as llama.cpp's end-of-generation tokens do. A file whose EOS is another token (a
# Llama 3 GGUF whose EOS is <|end_of_text|>) would otherwise write past the end of its turn. Document separators
# such as <|endoftext|> are not among them: a completion may go on past one, as transformers' generate does.
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>")


def end_token_ids(source: ModelSource, tokenizer) -> tuple[int, ...]:
    """The tokens besides the tokenizer's EOS that end a generation (stop token ids, as vLLM adds its generation
    config's other EOS ids to a request's): the model's own list (a GGUF file's `tokenizer.ggml.eot_token_id` and
    `eom_token_id`, a Hugging Face directory's generation_config.json `eos_token_id`) and the END_OF_TURN
    markers that are special tokens of this tokenizer."""
    ids: set[int] = set()
    try:
        if source.format == "gguf":
            from app.model.gguf_header import read_gguf_metadata

            metadata = read_gguf_metadata(source.path)
            ids.update(metadata[key] for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                       if isinstance(metadata.get(key), int))
        elif (source.path / "generation_config.json").is_file():
            import json

            config = json.loads((source.path / "generation_config.json").read_text(encoding="utf-8"))
            listed = config.get("eos_token_id") if isinstance(config, dict) else None
            ids.update(i for i in (listed if isinstance(listed, list) else [listed])
                       if isinstance(i, int) and not isinstance(i, bool))
    except (OSError, ValueError) as exc:  # the model's files were read at load; this adds to them, never fails
        log.warning("could not read the model's end-of-generation tokens from %s: %s", source.path, exc)
    special = {token.content: i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
               if token.special}
    ids.update(special[text] for text in END_OF_TURN if text in special)
    ids.discard(tokenizer.eos_token_id)
    return tuple(sorted(i for i in ids if 0 <= i < len(tokenizer)))


def load_exported(directory: str | Path):
    """A tokenizer that `export_tokenizer` wrote; does not import torch."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(directory))


def main(argv: list[str]) -> int:
    """Export into `out` whole or not at all (an earlier export there is replaced): the frontend's workers
    start using it the moment it exists. Says on stdout where it came from, for the bootstrap's log.
    `--convert` after the four arguments: from the model file even where the cache has it (a damaged entry)."""
    path, fmt, name, out, *flags = argv
    use_cache = "--convert" not in flags
    cached = _whole(out, lambda partial: export_tokenizer(ModelSource(Path(path), fmt, name), partial, use_cache))
    print(EXPORTED_FROM_CACHE if cached else EXPORTED_BY_CONVERSION, flush=True)
    return 0


def copy_cached_export(source: ModelSource, out: str) -> bool:
    """The cached export of `source`'s tokenizer into `out`, whole (as `main`), where there is one: the bootstrap
    does this itself, without the export's process (an interpreter and its imports: ~0.4 s of CPU beside the
    engine's start). False where there is none."""
    cached = cache_entry(source)
    if not _complete(cached):
        return False
    _whole(out, lambda partial: shutil.copytree(cached, partial))
    return True


def _whole(out: str, write):
    """`write(partial)`, then `partial` renamed to `out` (replacing it): `out` appears whole or not at all."""
    partial = Path(f"{out}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    result = write(partial)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(partial, out)
    return result


EXPORTED_FROM_CACHE = "copied from the cache"
EXPORTED_BY_CONVERSION = "converted from the model file"


EXPORT_WAIT_SECONDS = 600  # the bootstrap gives the export as long (app/bootstrap/supervisor.py)


def wait_for_export(directory: str | Path, timeout: float = EXPORT_WAIT_SECONDS, poll: float = 0.02) -> None:
    """Wait until the bootstrap's export lands in `directory` (the bootstrap stops the frontend sooner if the
    export fails). A worker that waits longer than gunicorn's timeout is restarted by gunicorn and waits again."""
    start, said = time.monotonic(), False
    while not os.path.isdir(directory):
        waited = time.monotonic() - start
        if waited > timeout:
            raise TimeoutError(f"no tokenizer export appeared in {directory} within {timeout} s")
        if waited > 5 and not said:  # a first start's export takes 2-3 s: say so only when it is unusually slow
            log.info("still waiting for the tokenizer export in %s", directory)
            said = True
        time.sleep(poll)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
