"""The exported tokenizer is cached across starts, keyed by the model file, and used as it was written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.model import tokenizer
from app.model.source import ModelSource, resolve_source
from app.spec.schema import ModelSpec
from tests.gguf_files import write_random_gguf


def test_a_second_export_copies_the_cached_one(tmp_path, monkeypatch):
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path / "cache"))
    source = resolve_source(ModelSpec())
    assert tokenizer.export_tokenizer(source, tmp_path / "first") is False  # converted
    entry = tokenizer.cache_entry(source)
    assert entry is not None and (entry / "tokenizer.json").is_file()
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind

    def no_conversion(_source):
        raise AssertionError("converted the GGUF tokenizer again instead of using the cache")

    monkeypatch.setattr(tokenizer, "load_tokenizer", no_conversion)
    assert tokenizer.export_tokenizer(source, tmp_path / "second") is True  # copied
    for name in os.listdir(tmp_path / "first"):
        assert (tmp_path / "second" / name).read_bytes() == (tmp_path / "first" / name).read_bytes(), name
    fast = tokenizer.load_exported(tmp_path / "second")
    assert fast("The capital of France is").input_ids == [504, 3575, 282, 4649, 314]
    # structured outputs' tokenizer.json text: read from the cache entry, the same bytes as the export
    assert tokenizer.tokenizer_json(source) == (tmp_path / "first" / "tokenizer.json").read_text(encoding="utf-8")


def test_the_bootstrap_copies_a_cached_export_itself_whole(tmp_path, monkeypatch):
    """`copy_cached_export` (the bootstrap's, with no process of its own): nothing where nothing is cached, the
    cached files where they are, replacing what was there, and no partial folder left."""
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path / "cache"))
    source = resolve_source(ModelSpec())
    out = tmp_path / "runtime" / "tokenizer"
    out.parent.mkdir()
    assert tokenizer.copy_cached_export(source, str(out)) is False and not out.exists()
    tokenizer.export_tokenizer(source, tmp_path / "first")
    out.mkdir()
    (out / "stale.json").write_text("{}")  # an earlier start's export: replaced whole
    assert tokenizer.copy_cached_export(source, str(out)) is True
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "first"))
    assert os.listdir(out.parent) == ["tokenizer"]
    assert tokenizer.load_exported(out)("The capital of France is").input_ids == [504, 3575, 282, 4649, 314]


def test_a_conversion_asked_for_replaces_the_cached_export(tmp_path, monkeypatch):
    """`--convert` (the bootstrap's retry where copying the cached export failed) converts, and stores anew."""
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path / "cache"))
    source = resolve_source(ModelSpec())
    tokenizer.export_tokenizer(source, tmp_path / "first")
    entry = tokenizer.cache_entry(source)
    (entry / "stale").write_text("")
    converted, real = [], tokenizer.load_tokenizer
    monkeypatch.setattr(tokenizer, "load_tokenizer", lambda s: converted.append(s) or real(s))
    assert tokenizer.main([str(source.path), source.format, "m", str(tmp_path / "out"), "--convert"]) == 0
    assert converted and not (entry / "stale").exists() and (entry / "tokenizer.json").is_file()
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.listdir(tmp_path / "first"))


def test_the_cache_key_follows_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 60)
    source = ModelSource(model, "gguf", "m")
    before = tokenizer.cache_entry(source)
    os.utime(model, ns=(1, 1))
    assert tokenizer.cache_entry(source) != before
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", "~nobody-here")
    assert tokenizer.cache_entry(source) is None


def test_an_unwritable_cache_is_skipped(tmp_path, monkeypatch):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(blocker))
    tokenizer.export_tokenizer(resolve_source(ModelSpec()), tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def _export_in_a_fresh_interpreter(path: Path, out: Path, cache: Path) -> list[str]:
    """`python -m app.model.tokenizer`, as the bootstrap runs it; returns which of torch and transformers'
    GGUF reader the export imported."""
    script = ("import sys; from app.model.tokenizer import main; main(sys.argv[1:]); "
              f"print(' '.join(m for m in ('torch', {tokenizer.READER_MODULE!r}) if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script, str(path), "gguf", "m", str(out)],
                          env=dict(os.environ, APPLIANCE_CACHE_DIR=str(cache)), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said, imported = done.stdout.split("\n", 1)
    assert said == tokenizer.EXPORTED_BY_CONVERSION  # (an empty cache) what the bootstrap logs
    return imported.split()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe", "mistral"])
def test_the_export_writes_what_autotokenizer_does_without_importing_torch(arch, tmp_path):
    """The export builds the class AutoTokenizer would pick, directly, with our GGUF reader standing in for
    transformers' (which imports torch: 1-2 s and ~200 MiB beside the engine's start); the files written must
    be the same, byte for byte, as AutoTokenizer's own. In a process that has torch already (the engine's,
    this one), the class is built with transformers' reader: the same again. ("mistral": a llama file whose
    general.name is "mistral", which transformers reads as a Mistral model.)"""
    from transformers import AutoTokenizer

    default = resolve_source(ModelSpec()).path
    if arch == "llama":
        path = default
    else:  # a tiny model of this architecture carrying the default model's tokenizer
        path = tmp_path / arch / "m.gguf"
        path.parent.mkdir()
        write_random_gguf(path, "llama" if arch == "mistral" else arch, seed=0, layers=1, hidden=64, inter=128,
                          heads=4, kv_heads=2, vocab=49152, qkv_bias=arch == "qwen2", tokenizer_of=default,
                          experts=4 if arch == "qwen3moe" else 0, expert_inter=32,
                          model_name="mistral" if arch == "mistral" else None)
    assert tokenizer.gguf_tokenizer_class(path) is not None
    assert _export_in_a_fresh_interpreter(path, tmp_path / "exported", tmp_path / "cache") == []
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    reference.save_pretrained(str(tmp_path / "reference"))
    in_process = tokenizer.load_tokenizer(ModelSource(path, "gguf", "m"))
    assert type(in_process) is type(reference)
    in_process.save_pretrained(str(tmp_path / "in-process"))
    names = sorted(os.listdir(tmp_path / "reference"))
    assert "tokenizer.json" in names
    for written in ("exported", "in-process"):
        assert sorted(os.listdir(tmp_path / written)) == names, written
        for name in names:
            assert (tmp_path / written / name).read_bytes() == (tmp_path / "reference" / name).read_bytes(), name
    text = "Héllo wörld 123 <|im_start|>user\n  spaces\ttabs 😀"
    assert tokenizer.load_exported(tmp_path / "exported")(text).input_ids == reference(text).input_ids


def test_the_classes_named_for_gguf_files_are_autotokenizers_choice():
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    from app.model.config import GGUF_ARCHITECTURES

    assert set(tokenizer.GGUF_TOKENIZER_CLASSES) == set(GGUF_ARCHITECTURES)
    for architecture, name in tokenizer.GGUF_TOKENIZER_CLASSES.items():
        model_type = {"qwen3moe": "qwen3_moe"}.get(architecture, architecture)  # as transformers reads the file
        assert name == (TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend"), architecture


def test_a_failed_build_without_torch_leaves_transformers_reader_in_place(monkeypatch, caplog):
    """Should a transformers release use its GGUF reader otherwise, the build under the stand-in fails: it
    says so and gives way (the caller builds it with transformers' reader), and the module table is as it was."""
    from app.model import gguf_header

    def unreadable(*_args):
        raise KeyError("a key this stand-in does not know")

    monkeypatch.setattr(gguf_header, "read_gguf_metadata", unreadable)
    path = resolve_source(ModelSpec()).path
    before = sys.modules.get(tokenizer.READER_MODULE)
    assert tokenizer._build_without_torch(tokenizer.gguf_tokenizer_class(path), path) is None
    assert sys.modules.get(tokenizer.READER_MODULE) is before
    assert "without torch failed (KeyError" in caplog.text


def test_a_tokenizer_config_beside_the_file_leaves_the_choice_to_autotokenizer(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    assert tokenizer.gguf_tokenizer_class(tmp_path / "m.gguf") is None


def test_the_export_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """The frontend's workers wait for the export's directory and use it the moment it exists."""
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "tokenizer"
    real_export = tokenizer.export_tokenizer

    def half_then_fail(source, directory, use_cache=True):
        Path(directory).mkdir(parents=True)
        (Path(directory) / "tokenizer.json").write_text("{")
        raise RuntimeError("the export failed half-way")

    monkeypatch.setattr(tokenizer, "export_tokenizer", half_then_fail)
    with pytest.raises(RuntimeError, match="half-way"):
        tokenizer.main([str(resolve_source(ModelSpec()).path), "gguf", "m", str(out)])
    assert not out.exists()  # the half-written files stayed in the partial directory

    monkeypatch.setattr(tokenizer, "export_tokenizer", real_export)
    errors = []

    def export_later():
        time.sleep(0.2)
        try:
            tokenizer.main([str(resolve_source(ModelSpec()).path), "gguf", "m", str(out)])
        except Exception as exc:  # noqa: BLE001 (shown by the assertion below instead of a silent thread)
            errors.append(exc)
            out.mkdir()  # release the waiter

    thread = threading.Thread(target=export_later)
    thread.start()
    tokenizer.wait_for_export(out, timeout=120)
    thread.join()
    assert not errors, errors
    assert json.loads((out / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert not (tmp_path / "tokenizer.partial").exists()
