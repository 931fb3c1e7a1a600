"""The spec: accepted spellings, defaults, overrides, the effective spec, and the shipped examples."""

from __future__ import annotations

import pytest

from app.spec.errors import SpecError
from app.spec.load import dump_spec, load_spec, parse_spec
from app.spec.schema import DEFAULT_MODEL_PACKAGE_FILE, Spec
from tests.conftest import CONFIG, TOPOLOGIES, run_cli


def spec_of(text: str, *overrides: str) -> Spec:
    return parse_spec(text, overrides=overrides).spec


def test_empty_spec_is_every_default():
    spec = spec_of("")
    assert spec == Spec()
    assert spec.model.package == DEFAULT_MODEL_PACKAGE_FILE and spec.model.path is None
    assert (spec.parallel.tp, spec.parallel.dp, spec.cores.ranks, spec.runtime.allocator) == (1, 1, "auto", "jemalloc")


def test_default_yaml_is_the_defaults_plus_a_served_name_float32_and_a_bfloat16_kv_cache():
    spec = load_spec(CONFIG / "default.yaml")
    assert spec.model.name == "SmolLM2-135M-Instruct" and spec.model.dtype == "float32"
    assert spec.kv_cache.dtype == "bfloat16"
    model = spec.model.model_copy(update={"name": None, "dtype": "auto"})
    kv_cache = spec.kv_cache.model_copy(update={"dtype": "auto"})
    assert spec.model_copy(update={"model": model, "kv_cache": kv_cache}) == Spec()


@pytest.mark.parametrize(("ranks", "expected"), [
    ('"0-3|4-7"', ((0, 1, 2, 3), (4, 5, 6, 7))),
    ('[[0, 1], "2-3"]', ((0, 1), (2, 3))),
    ('["0-7:2", "1,3"]', ((0, 2, 4, 6), (1, 3))),
])
def test_explicit_rank_lists_in_every_spelling(ranks, expected):
    assert spec_of(f"parallel: {{tp: 2}}\ncores: {{ranks: {ranks}}}").cores.ranks == expected


def test_one_rank_on_one_cpu_may_be_a_bare_number():
    """YAML reads `ranks: 1` (and `--set cores.ranks=1`) as an integer: one rank on CPU 1, not a type error."""
    assert spec_of("cores: {ranks: 1}").cores.ranks == spec_of("cores: {ranks: '1'}").cores.ranks == ((1,),)
    assert spec_of("", "cores.ranks=0").cores.ranks == ((0,),)


@pytest.mark.parametrize(("memory", "expected"), [
    ("0.3", 0.3), ('"30%"', 0.3), ("4GiB", 4 * 1024**3), ('"512 MiB"', 512 * 1024**2), ("2GB", 2 * 10**9),
])
def test_kv_memory_spellings(memory, expected):
    assert spec_of(f"kv_cache: {{memory: {memory}}}").kv_cache.memory == pytest.approx(expected)


def test_set_overrides_values_and_creates_sections():
    spec = spec_of("parallel: {tp: 1}", "parallel.tp=2", "server.port=9000", "cores.ranks=0-3|4-7",
                   "server.api_key.env=MY_KEY", "server.cors_origins=['*']")
    assert (spec.parallel.tp, spec.server.port, spec.server.api_key.env) == (2, 9000, "MY_KEY")
    assert spec.cores.ranks == ((0, 1, 2, 3), (4, 5, 6, 7)) and spec.server.cors_origins == ["*"]


def test_effective_spec_round_trips():
    spec = spec_of('parallel: {tp: 2}\ncores: {ranks: "0-3|4-7", frontend: "8"}\nkv_cache: {memory: 4GiB}\n'
                   "server: {api_key: {file: /run/key}}")
    text = dump_spec(spec)
    assert "ranks:\n  - 0-3\n  - 4-7" in text and "memory: 4GiB" in text
    assert spec_of(text) == spec


def test_validate_print_shows_the_effective_spec():
    result = run_cli("validate", "-c", str(CONFIG / "default.yaml"), "--root", str(TOPOLOGIES / "1s-4n-nps4"),
                     "--print", "--set", "parallel.dp=2")
    assert result.code == 0, result.err
    assert spec_of(result.out).parallel.dp == 2
    assert "OK: SmolLM2-135M-Instruct, 2 replica(s) x 1 TP rank(s), float32" in result.err


def test_errors_carry_line_numbers_even_after_loading(tmp_spec):
    path = tmp_spec("# comment\nparallel:\n  tp: 1\n\nkv_cache:\n  memory: 900GiB\n")
    result = run_cli("validate", "-c", path, "--root", str(TOPOLOGIES / "1s-4n-nps4"))
    assert result.code == 2 and f"{path}:6: kv_cache.memory:" in result.err


def test_spec_error_lists_problems_in_order():
    with pytest.raises(SpecError) as error:
        spec_of("parallel: {tp: 0, dp: 0}")
    assert [p.path for p in error.value.problems] == ["parallel.tp", "parallel.dp"]


# Each example with the machine it is written for.
EXAMPLES = {
    "default.yaml": ("this-machine", []),
    "tp2-numa.yaml": ("2s-2n-32c-smt2", []),
    "dp2.yaml": ("1s-4n-nps4", []),
    "explicit-cores.yaml": ("2s-2n-32c-smt2", []),
    "kubernetes.yaml": ("k8s-cpuset8-smt", ["model_path"]),
}


def test_every_example_is_listed():
    assert sorted(p.name for p in CONFIG.glob("*.yaml")) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_validates_on_its_machine(name):
    machine, needs = EXAMPLES[name]
    extra = []
    if "model_path" in needs:  # the pod mounts its model; here we point at the embedded one
        from app.model.source import resolve_source

        extra = ["--set", f"model.path={resolve_source(spec_of('').model).path}"]
    result = run_cli("validate", "-c", str(CONFIG / name), "--root", str(TOPOLOGIES / machine), *extra)
    assert result.code == 0, result.err
    assert "OK:" in result.err


def test_tp2_example_plans_one_rank_per_socket():
    import json

    result = run_cli("plan", "-c", str(CONFIG / "tp2-numa.yaml"), "--root", str(TOPOLOGIES / "2s-2n-32c-smt2"), "--json")
    ranks = json.loads(result.out)["ranks"]
    assert [(r["cpulist"], r["node"]) for r in ranks] == [("0-31", 0), ("32-63", 1)]


def test_spec_docs_are_generated_from_the_code():
    from app.spec.docs import spec_markdown

    from tests.conftest import REPO

    assert (REPO / "docs" / "SPEC.md").read_text() == spec_markdown(), "rerun: python -m app spec-docs > docs/SPEC.md"
    for section, model in Spec.model_fields.items():
        for key, field in model.annotation.model_fields.items():
            assert field.description, f"{section}.{key} has no docstring"
            assert f"| `{key}` |" in spec_markdown()
