"""Command line: `python -m app <command>` (or `appliance <command>`).

Exit codes: 0 success, 2 a spec (or machine) problem the user can fix, with every problem printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict

from app.bootstrap.isa import check_isa
from app.bootstrap.startup import Deployment, api_key, check_listen, prepare
from app.model.source import resolve_source
from app.spec.errors import SpecError
from app.spec.load import dump_spec, read_spec
from app.topology.machine import read_topology

EXIT_SPEC = 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except SpecError as error:
        print(error.render(), file=sys.stderr)
        return EXIT_SPEC


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description="CPU-only LLM inference appliance.")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    _command(commands, "validate", _validate, "check a spec against this machine; exit 2 with every problem",
             lambda p: p.add_argument("--print", action="store_true", help="print the effective spec (defaults filled in)"))
    _command(commands, "plan", _plan, "print where every rank runs: CPUs, NUMA node, OpenMP env, KV cache",
             lambda p: p.add_argument("--json", action="store_true", help="JSON instead of a table"))
    _command(commands, "preflight", _preflight, "check ISA and preloaded libraries; re-exec with them preloaded",
             lambda p: p.add_argument("--json", action="store_true", help="JSON instead of text"))
    _bench_parsers(commands)
    docs = commands.add_parser("spec-docs", help="print docs/SPEC.md, generated from the spec's field docs")
    docs.set_defaults(run=_spec_docs)
    schema = commands.add_parser("spec-schema", help="print config/spec.schema.json: the spec's JSON Schema, "
                                                     "for editors")
    schema.add_argument("--helm", action="store_true", help="print helm/values.schema.json instead (the chart's "
                                                             "values, the spec inside)")
    schema.set_defaults(run=_spec_schema)
    serve = commands.add_parser("serve", help="start the appliance: engine process and OpenAI-compatible HTTP server")
    serve.add_argument("-c", "--config", metavar="SPEC", help="the YAML spec (default: every default)")
    serve.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec value")
    serve.add_argument("--host", help="listen address: short for --set server.host=HOST")
    serve.add_argument("--port", type=int, help="listen port: short for --set server.port=PORT")
    serve.set_defaults(run=_serve)
    topo = commands.add_parser("topology", help="show the CPU/NUMA/cgroup topology as the planner sees it")
    topo.add_argument("--root", default="/", help="read a captured tree instead of this machine")
    topo.add_argument("--json", action="store_true", help="JSON instead of text")
    topo.add_argument("--capture", metavar="DIR", help="copy the files the reader uses into DIR (for tests or bug reports)")
    topo.set_defaults(run=_topology)
    return parser


def _bench_parsers(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks: serve (any OpenAI server), offline (the engine), model",
                                description="benchmarks: a server over HTTP, the engine offline, the model's steps")
    kinds = bench.add_subparsers(required=True, metavar="KIND")
    serve = kinds.add_parser("serve", help="load an OpenAI-compatible server (ours or a peer's) and report latencies",
                             description="Stream /v1/completions at fixed concurrency levels (or a request rate) "
                                         "and report throughput and TTFT/TPOT/ITL/E2EL percentiles, as vllm bench "
                                         "serve does.")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    serve.add_argument("--model", help="model id to request (default: the server's first in /v1/models)")
    serve.add_argument("--label", help="name of this server in the JSON and the plot (default: the model id)")
    serve.add_argument("--api-key", help="sent as a Bearer token (default: $OPENAI_API_KEY, if set)")
    serve.add_argument("--input-len", type=int, default=128, help="prompt tokens (random ids) per request")
    serve.add_argument("--output-len", type=int, default=128, help="tokens generated per request (ignore_eos)")
    serve.add_argument("--num-prompts", type=int, default=32, help="measured requests per concurrency level")
    serve.add_argument("--concurrency", type=int, nargs="+", default=[1], help="levels to run (default: 1)")
    serve.add_argument("--request-rate", type=float, default=float("inf"),
                       help="Poisson arrivals at this many requests/s (default: inf, as fast as concurrency allows)")
    serve.add_argument("--warmup", type=int, default=1, help="requests sent first and not measured")
    serve.add_argument("--prompts-file", help="JSONL of {\"prompt\": text} lines instead of random ids")
    serve.add_argument("--seed", type=int, default=0,
                       help="random prompts' seed (default: 0); a second run against the same server with the same "
                            "seed finds its prompts in the prefix cache: give it a new seed")
    serve.add_argument("--temperature", type=float, default=0.0,
                       help="sampling temperature of every request (default: 0, greedy, as vllm bench serve's runs "
                            "here; 1 is OpenAI's default)")
    serve.add_argument("--json", dest="json_out", metavar="FILE", help="append the results to this JSON list")
    serve.add_argument("--plot", metavar="PNG", help="draw latency vs throughput of the results (and the JSON's)")
    serve.set_defaults(run=_bench_serve)
    plot = kinds.add_parser("plot", help="draw latency vs throughput from bench serve JSON files",
                            description="one line per server label, one point per concurrency level")
    plot.add_argument("files", nargs="+", help="JSON files written by bench serve --json (or by vllm bench serve "
                                               "--save-result, labelled by file name up to its last '-')")
    plot.add_argument("-o", "--output", required=True, metavar="PNG")
    plot.add_argument("--title", default="")
    plot.set_defaults(run=_bench_plot)
    offline = kinds.add_parser("offline", help="offline throughput through the engine (LLM.generate)")
    offline.add_argument("-c", "--config", metavar="SPEC", help="the spec (default: every default)")
    offline.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype (default: the spec's)")
    offline.add_argument("--requests", type=int, default=64)
    offline.add_argument("--input-len", type=int, default=256)
    offline.add_argument("--output-len", type=int, default=128)
    offline.add_argument("--max-num-seqs", type=int, metavar="N",
                         help="at most N requests running at once, as a client keeping N streams open allows "
                              "(default: the spec's scheduler.max_num_seqs)")
    offline.add_argument("--prefix-workload", action=argparse.BooleanOptionalAction, default=True,
                         help="also time a shared-prefix workload with prefix caching on and off (default: on)")
    offline.set_defaults(run=_bench_offline)
    model = kinds.add_parser("model", help="time prefill and decode steps of the model on this machine")
    model.add_argument("-c", "--config", metavar="SPEC", help="the spec whose model to time (default: every default)")
    model.add_argument("--dtype", action="append", choices=["float32", "bfloat16"], help="repeatable; default: both")
    model.add_argument("--quantized", action="append", choices=["keep", "dequantize"],
                       help="GGUF quantized weights kept or expanded at load; repeatable; default: the spec's")
    model.add_argument("--activations", action="append", choices=["int16", "int8", "float"],
                       help="how activations meet kept-quantized weights; repeatable; default: the spec's")
    model.add_argument("--kv-dtype", choices=["float32", "bfloat16", "float16"],
                       help="KV cache dtype (default: the spec's; its \"auto\" is bfloat16 under bfloat16 compute, "
                            "float16 under float32)")
    model.add_argument("--python-layers", action="store_true",
                       help="run the layers one Python-level kernel call at a time, not as one native stack")
    model.add_argument("--batch", action="append", type=int, help="decode batch sizes; default: 1 and 16")
    model.add_argument("--context", type=int, default=512, help="tokens already in each sequence's cache")
    model.add_argument("--prompt", type=int, default=512, help="prompt length for the prefill measurement")
    model.add_argument("--chunk", type=int, help="prefill the prompt this many tokens per step (default: all at once)")
    model.add_argument("--steps", type=int, default=32, help="decode steps timed (median reported)")
    model.add_argument("--bf16-dot", choices=["auto", "on", "off"], default="auto",
                       help="bfloat16 pairs on vdpbf16ps (on) or float32 FMAs (off); auto: what this CPU measures "
                            "faster (the engine's choice)")
    model.add_argument("--amx-tiles", choices=["auto", "off"], default="auto",
                       help="int16 row chunks of 16 rows and more on AMX-INT8 tiles where the CPU has them (auto, the "
                            "engine's choice) or on the vector tiles (off)")
    model.set_defaults(run=_bench_model)


def _command(commands, name: str, run: Callable, help_text: str, extra: Callable) -> None:
    parser = commands.add_parser(name, help=help_text, description=help_text)
    parser.add_argument("-c", "--config", metavar="SPEC", help="the YAML spec (default: every default)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec value, e.g. --set parallel.tp=2 (repeatable)")
    if name != "preflight":
        parser.add_argument("--root", default="/", help="plan for a captured machine tree instead of this machine")
    extra(parser)
    parser.set_defaults(run=run)


def _deployment(args: argparse.Namespace) -> Deployment:
    return prepare(args.config, args.set, root=getattr(args, "root", "/"))


def _validate(args: argparse.Namespace) -> int:
    ctx = _deployment(args)
    warnings = list(ctx.plan.warnings)
    # what `serve` checks on the machine it runs on, which need not be this one (a pod's secret and address): warned
    for check in (lambda: api_key(ctx.spec.server.api_key), lambda: check_listen(ctx.spec.server.host, 0)):
        try:
            check()
        except SpecError as error:
            warnings += [f"{line}; `serve` stops there" for line in str(ctx.doc.locate(error)).splitlines()]
    plan = ctx.plan
    if args.print:
        print(dump_spec(ctx.doc.spec), end="")
    replicas = len({r.replica for r in plan.ranks})
    print(f"{ctx.doc.source}: OK: {ctx.source.served_name}, {replicas} replica(s) x "
          f"{len(plan.ranks) // replicas} TP rank(s), {plan.dtype}", file=sys.stderr)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from app.placement.render import plan_json, plan_table

    ctx = _deployment(args)
    render = plan_json if args.json else plan_table
    print(render(ctx.plan, ctx.source, ctx.footprint, ctx.topology))
    return 0


def _preflight(args: argparse.Namespace) -> int:
    from app.bootstrap.isa import has_native_bf16
    from app.bootstrap.preflight import run_preflight

    doc = read_spec(args.config, args.set)
    topo = read_topology("/")
    check_isa(topo)
    report = run_preflight(doc.spec.runtime, topo.arch)
    data = {"arch": topo.arch, "cpu_model": topo.cpu_model, "isa": sorted(topo.isa),
            "native_bf16": has_native_bf16(topo), **asdict(report)}
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for key, value in data.items():
            if key != "warnings":
                print(f"{key:15} {value}")
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from app.bootstrap.serve import serve

    shortcuts = [f"server.{key}={value}" for key, value in (("host", args.host), ("port", args.port))
                 if value is not None]
    return serve(args.config, [*args.set, *shortcuts])


def _bench_model(args: argparse.Namespace) -> int:
    from app import kernels
    from app.benchmark.model import run

    doc = read_spec(args.config, [])
    with kernels.use_bf16_dot(args.bf16_dot), kernels.use_amx_tiles(args.amx_tiles):
        run(resolve_source(doc.spec.model), args.dtype or ["float32", "bfloat16"], args.batch or [1, 16], args.context,
            args.prompt, args.steps, args.chunk, args.quantized or [doc.spec.model.quantized],
            args.activations or [doc.spec.model.quantized_activations], args.kv_dtype or doc.spec.kv_cache.dtype,
            not args.python_layers)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    import httpx

    from app.benchmark.serve import Workload, plot, require_matplotlib, run

    if args.plot:
        require_matplotlib()
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    model = args.model
    if model is None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            models = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()
            model = models["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            print(f"bench serve: cannot read the model id from {args.base_url}/v1/models ({exc}); pass --model",
                  file=sys.stderr)
            return 1
    workloads = [Workload(args.input_len, args.output_len, args.num_prompts, c, args.request_rate, args.warmup,
                          args.seed, args.temperature) for c in args.concurrency]
    results = run(args.base_url, model, workloads, args.label or model, api_key,
                  Path(args.prompts_file) if args.prompts_file else None)
    if args.json_out:
        path = Path(args.json_out)
        results = (json.loads(path.read_text()) if path.exists() else []) + results
        path.write_text(json.dumps(results, indent=1) + "\n")
    else:
        print(json.dumps(results, indent=1))
    if args.plot:
        plot(results, Path(args.plot))
    return 0 if all(r["failed"] == 0 for r in results) else 1


def _bench_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from app.benchmark.serve import plot, read_results

    results = [r for f in args.files for r in read_results(Path(f))]
    plot(results, Path(args.output), args.title)
    return 0


def _bench_offline(args: argparse.Namespace) -> int:
    from app.benchmark.offline import run

    run(args.config, args.dtype, args.requests, args.input_len, args.output_len, args.max_num_seqs,
        args.prefix_workload)
    return 0


def _spec_docs(args: argparse.Namespace) -> int:
    from app.spec.docs import spec_markdown

    print(spec_markdown(), end="")
    return 0


def _spec_schema(args: argparse.Namespace) -> int:
    from app.spec.docs import chart_values_schema, spec_schema

    print(chart_values_schema() if args.helm else spec_schema(), end="")
    return 0


def _topology(args: argparse.Namespace) -> int:
    from app.topology.capture import capture, describe

    if args.capture:
        written = capture(args.root, args.capture)
        print(f"captured {written} files into {args.capture}", file=sys.stderr)
        return 0
    topo = read_topology(args.root)
    print(json.dumps(asdict(topo), indent=2, default=sorted) if args.json else describe(topo))
    return 0
