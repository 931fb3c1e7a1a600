"""The engine keeps its step cost's fit across starts (app.cache): under a key naming everything the fit depends
on, checked against the first timed pass, rebuilt where damaged, skipped where it cannot be written."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest

from app.bootstrap.startup import prepare
from app.engine.core import EngineCore
from app.engine.kv_cache import KVCacheConfig
from app.engine.process import calibration_key
from app.engine.scheduler import SchedulerConfig
from app.engine.step_cost import attention_pairs

SCHEDULER = SchedulerConfig(8, 512, 1024, True, step_time_budget=0.5)


class TimedMachine:
    """The engine core's view of a model where only step times matter: passes take 20 ms + `per_token` a token
    + 2 us a pair, on a clock the test owns."""

    vocab_size = 100

    def __init__(self, clock: dict, per_token: float):
        self.clock, self.per_token, self.passes = clock, per_token, []

    def time_forward(self, count: int, num_computed: int, decodes: bool = False) -> None:
        self.passes.append(count)
        pairs = sum(attention_pairs(i, 1) for i in range(count)) if decodes else attention_pairs(num_computed, count)
        self.clock["now"] += 0.02 + self.per_token * count + 2e-6 * pairs


@pytest.fixture
def clock(monkeypatch) -> dict:
    now = {"now": 0.0}
    monkeypatch.setattr("app.engine.step_cost.time.perf_counter", lambda: now["now"])
    return now


def _start(machine: TimedMachine, key: dict | None, cache: Path | None) -> EngineCore:
    return EngineCore(machine, SCHEDULER, KVCacheConfig(64, 16), "m", calibration_key=key, cache=cache)


def test_a_second_start_keeps_the_first_starts_fit(clock, tmp_path):
    first = _start(TimedMachine(clock, 2e-3), {"model": "a"}, tmp_path / "cache")
    entries = list((tmp_path / "cache" / "calibration").iterdir())
    assert len(entries) == 1 and json.loads(entries[0].read_text()) == first.cost.to_json()
    again = TimedMachine(clock, 2e-3)
    second = _start(again, {"model": "a"}, tmp_path / "cache")
    assert second.cost.from_cache and again.passes == [16, 16, 16, 1, 1]  # the warm-up and the checks' passes
    assert second.cost.to_json() == first.cost.to_json()
    other = TimedMachine(clock, 2e-3)
    assert not _start(other, {"model": "b"}, tmp_path / "cache").cost.from_cache and len(other.passes) > 5  # its own
    assert len(list((tmp_path / "cache" / "calibration").iterdir())) == 2


def test_a_fit_that_no_longer_agrees_or_is_damaged_is_made_anew_and_written_over(clock, tmp_path):
    _start(TimedMachine(clock, 2e-3), {"model": "a"}, tmp_path / "cache")
    [entry] = (tmp_path / "cache" / "calibration").iterdir()
    slower = _start(TimedMachine(clock, 4e-3), {"model": "a"}, tmp_path / "cache")  # busier: passes of 16 take 1.6x
    assert not slower.cost.from_cache and slower.cost.per_token == pytest.approx(4e-3, rel=1e-6)
    assert json.loads(entry.read_text()) == slower.cost.to_json()
    entry.write_text('{"overhead": 0.02, "per_tok')  # a half-written file (not from us: we rename into place)
    damaged = _start(TimedMachine(clock, 4e-3), {"model": "a"}, tmp_path / "cache")
    assert not damaged.cost.from_cache and json.loads(entry.read_text()) == damaged.cost.to_json()


def test_without_a_key_or_a_writable_cache_the_engine_calibrates_as_before(clock, tmp_path):
    for key, cache in ((None, tmp_path / "cache"), ({"model": "a"}, None)):
        machine = TimedMachine(clock, 2e-3)
        assert not _start(machine, key, cache).cost.from_cache and len(machine.passes) > 5
    assert not (tmp_path / "cache").exists()
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    assert _start(TimedMachine(clock, 2e-3), {"model": "a"}, blocker).cost.per_token == pytest.approx(2e-3, rel=1e-6)


def test_the_key_names_the_file_how_it_is_run_and_the_threads(tmp_path):
    launches = prepare(None, ["cores.reserve_frontend=0"]).launches()
    assert launches[0].cache_dir == os.environ["APPLIANCE_CACHE_DIR"]  # the bootstrap hands the engines its cache
    model = tmp_path / "model.gguf"
    shutil.copyfile(launches[0].model.path, model)
    base = [dataclasses.replace(r, model=dataclasses.replace(r.model, path=str(model))) for r in launches]
    key = calibration_key(base)
    assert key == calibration_key(base) and json.dumps(key)  # stable, and JSON (it is hashed as such)

    def changed(**fields) -> list:
        return [dataclasses.replace(r, model=dataclasses.replace(r.model, **fields)) for r in base]
    assert calibration_key(changed(quantized_activations="int8")) != key
    # the other dtype (the spec's "auto" is bfloat16 where the CPU has AVX512-BF16, else float32)
    assert calibration_key(changed(dtype={"bfloat16": "float32"}.get(base[0].model.dtype, "bfloat16"))) != key
    more = [dataclasses.replace(r, placement=dataclasses.replace(r.placement, cpus=(*r.placement.cpus, 99)))
            for r in base]
    assert calibration_key(more) != key  # another thread a rank
    os.utime(model, ns=(1, 1))  # the file replaced by another of the same size
    assert calibration_key(base) != key
    model.unlink()
    assert calibration_key(base) is None
