"""The exported tokenizer is cached across starts, keyed by the model file, and used as it was written."""

from __future__ import annotations

import os

from app.model import tokenizer
from app.model.source import ModelSource, resolve_source
from app.spec.schema import ModelSpec


def test_a_second_export_copies_the_cached_one(tmp_path, monkeypatch):
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path / "cache"))
    source = resolve_source(ModelSpec())
    tokenizer.export_tokenizer(source, tmp_path / "first")
    entry = tokenizer.cache_entry(source)
    assert entry is not None and (entry / "tokenizer.json").is_file()
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind

    def no_conversion(_source):
        raise AssertionError("converted the GGUF tokenizer again instead of using the cache")

    monkeypatch.setattr(tokenizer, "load_tokenizer", no_conversion)
    tokenizer.export_tokenizer(source, tmp_path / "second")
    for name in os.listdir(tmp_path / "first"):
        assert (tmp_path / "second" / name).read_bytes() == (tmp_path / "first" / name).read_bytes(), name
    fast = tokenizer.load_exported(tmp_path / "second")
    assert fast("The capital of France is").input_ids == [504, 3575, 282, 4649, 314]


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
