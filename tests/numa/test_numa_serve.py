"""`serve` with tp=2 and dp=2 inside a four-node NUMA guest of one CPU a node: each replica's two ranks on two
nodes (tensor parallel across NUMA nodes), the two replicas on the other two; every rank process runs on the
plan's CPU, its thread pinned there, with its memory policy bound to its own node and its pages there.

One boot, one serve (tests/numa/guest_serve.py): the supervisor starting replicas and each replica's rank 0
starting its TP worker, in one start. It was two, tp=2 on two nodes then dp=2 (7.7 min of a 39-minute CI run;
this one 6.5 min run alone, the imports of four ranks and the frontend under emulation being most of it): a rank
with two CPUs pinning its two OpenMP threads is test_numa_vm.py's bind test and tests/kernels/test_binding.py's.
The model is a random-weight Llama GGUF with SmolLM2's tokenizer, small enough for software emulation.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from app.model.source import resolve_source
from app.model.tokenizer import export_tokenizer
from app.spec.schema import ModelSpec
from tests.gguf_files import write_random_gguf

pytestmark = pytest.mark.numa_vm

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 64, 4, 2, 128, 2


def _write_tiny_llama(path: Path) -> None:
    tokenizer = resolve_source(ModelSpec()).path  # the default model's tokenizer, so the server can tokenize
    write_random_gguf(path, "llama", seed=0, layers=LAYERS, hidden=HIDDEN, inter=INTER, heads=HEADS,
                      kv_heads=KV_HEADS, vocab=49152, tokenizer_of=tokenizer)


@pytest.fixture(scope="module")
def reports(run_in_guest, tmp_path_factory) -> dict[str, dict]:
    model = tmp_path_factory.mktemp("numa-serve") / "tiny-llama.gguf"  # under /tmp: the guest sees it
    _write_tiny_llama(model)
    # Its tokenizer exported here, into a cache under /tmp, which the guest sees too: converted under emulation
    # it took 140 of the guest's 410 s, and is not what these tests are about (app/model/tokenizer.py's cache).
    cache = tmp_path_factory.mktemp("appliance-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("APPLIANCE_CACHE_DIR", str(cache))
        export_tokenizer(resolve_source(ModelSpec(path=str(model))), tmp_path_factory.mktemp("tokenizer"))
    child = run_in_guest(sys.executable, "tests/numa/guest_serve.py", str(model), timeout=1500, nodes=4,
                         cpus_per_node=1, mem="1G", env={"APPLIANCE_CACHE_DIR": str(cache)})
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    found = [json.loads(line.split(" ", 1)[1]) for line in child.stdout.splitlines() if line.startswith("REPORT ")]
    return {f"tp{r['tp']}-dp{r['dp']}": r for r in found}


def test_each_rank_runs_and_allocates_where_the_plan_says(reports):
    report = reports["tp2-dp2"]
    assert report["exit_code"] == 0, report["log_tail"]
    assert report["completion"]["completion_tokens"] == 4  # it served
    plan = {(r["replica"], r["rank"]): r for r in report["plan"]}
    # one rank per NUMA node: replica 0's TP ranks on nodes 0 and 1, replica 1's on 2 and 3
    assert {key: r["node"] for key, r in plan.items()} == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}
    ranks = {(r["replica"], r["rank"]): r for r in report["ranks"]}
    assert set(ranks) == set(plan)
    for key, rank in ranks.items():
        cpus, node = plan[key]["cpus"], plan[key]["node"]
        pinned = [t["cpus"] for t in rank["threads"]]
        # every thread is pinned to one CPU of the plan's, and each of the plan's CPUs has its OpenMP thread
        assert set(pinned) == {str(c) for c in cpus}, (key, cpus, rank["threads"])
        # the memory policy: bound to the rank's node for every anonymous mapping ...
        assert set(rank["anon_policies"]) == {f"bind:{node}"}, (key, rank["anon_policies"])
        # ... and its pages there: at least its weights (loaded after it bound itself). What the interpreter
        # and torch's import touched before that may sit on the other node: a TP worker, spawned by rank 0,
        # imports torch before it binds (about 150 MiB); the KV cache is allocated empty, resident as used.
        pages = {int(n): count for n, count in rank["anon_pages_by_node"].items()}
        assert pages.get(node, 0) * 4096 >= plan[key]["weight_bytes"], (key, pages)
        elsewhere = sum(count for n, count in pages.items() if n != node)
        assert elsewhere * 4096 <= 256 << 20, (key, pages)
