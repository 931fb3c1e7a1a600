"""The one start sequence and the launch records it gives each rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.bootstrap.startup import prepare
from app.spec.errors import SpecError
from tests.conftest import TOPOLOGIES


def test_launch_records_follow_the_plan(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("parallel: {tp: 2, dp: 2}\nmodel: {dtype: float32}\nkv_cache: {memory: 1GiB}\n"
                    "scheduler: {max_num_seqs: 32, step_time_budget: 0.25}\n")
    deployment = prepare(spec, ["runtime.openmp=gnu"], root=TOPOLOGIES / "2s-2n-32c-smt2")
    launches = deployment.launches(Path("/run/x"))
    plan = deployment.plan
    assert [(l.replica, l.rank, l.tp) for l in launches] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    for launch, rank in zip(launches, plan.ranks, strict=True):
        assert launch.placement.cpus == rank.cpus and launch.placement.memory_nodes == rank.memory_nodes
        assert launch.placement.openmp_env == rank.openmp_env
        replica_blocks = [r.kv_blocks for r in plan.ranks if r.replica == rank.replica]
        assert launch.kv.num_blocks == min(replica_blocks) and launch.kv.block_size == plan.block_size
        assert launch.scheduler.max_num_seqs == 32 and launch.scheduler.step_time_budget == 0.25
        assert launch.scheduler.max_model_len == plan.max_model_len
        assert launch.model.dtype == "float32" and launch.model.model_id.endswith(".gguf:float32:keep:int16")
    assert [l.address for l in launches] == ["ipc:///run/x/engine-0.ipc", "", "ipc:///run/x/engine-1.ipc", ""]
    assert [l.name for l in launches] == ["engine-0.0", "engine-0.1", "engine-1.0", "engine-1.1"]


def test_errors_on_the_way_are_located_in_the_spec(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("parallel:\n  tp: 64\n")
    with pytest.raises(SpecError) as error:
        prepare(spec, [], root=TOPOLOGIES / "this-machine")
    assert f"{spec}:" in error.value.render()


def test_chat_template_override_is_read_from_a_file(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    deployment = prepare(None, [f"model.chat_template={template}"], root=TOPOLOGIES / "this-machine")
    assert deployment.chat_template() == "{{ messages[0].content }}"
    assert prepare(None, [], root=TOPOLOGIES / "this-machine").chat_template() is None


def test_a_read_only_root_without_a_temporary_directory_is_told_how_to_give_one(monkeypatch):
    """`docker run --read-only` without `--tmpfs /tmp`: a one-line error naming the fix, before anything starts (it
    had been a traceback from tempfile)."""
    import tempfile

    from app.bootstrap.serve import serve

    def none_usable():
        raise FileNotFoundError(2, "No usable temporary directory found in ['/tmp', '/var/tmp', '/usr/tmp']")

    monkeypatch.setattr(tempfile, "gettempdir", none_usable)
    with pytest.raises(SpecError) as refused:
        serve(None, [])
    assert "(filesystem): found no writable $TMPDIR, /tmp" in str(refused.value)
    assert "docker run --tmpfs /tmp" in str(refused.value)
