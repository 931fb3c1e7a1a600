"""Command line: `python -m app <command>` (or `appliance <command>`).

Exit codes: 0 success, 2 a spec (or machine) problem the user can fix, with every problem printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

from app.bootstrap.isa import check_isa
from app.model.footprint import ModelFootprint, read_footprint
from app.model.source import ModelSource, resolve_source, source_key
from app.spec.errors import SpecError
from app.spec.load import SpecDocument, dump_spec, read_spec
from app.topology.machine import Topology, read_topology

EXIT_SPEC = 2


@dataclass(frozen=True)
class Context:
    doc: SpecDocument
    topo: Topology
    source: ModelSource
    model: ModelFootprint


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
    bench = commands.add_parser("bench-model", help="time prefill and decode steps of the model on this machine")
    bench.add_argument("-c", "--config", metavar="SPEC", help="the spec whose model to time (default: every default)")
    bench.add_argument("--dtype", action="append", choices=["float32", "bfloat16"], help="repeatable; default: both")
    bench.add_argument("--batch", action="append", type=int, help="decode batch sizes; default: 1 and 16")
    bench.add_argument("--context", type=int, default=512, help="tokens already in each sequence's cache")
    bench.add_argument("--prompt", type=int, default=512, help="prompt length for the prefill measurement")
    bench.add_argument("--chunk", type=int, help="prefill the prompt this many tokens per step (default: all at once)")
    bench.add_argument("--steps", type=int, default=32, help="decode steps timed (median reported)")
    bench.set_defaults(run=_bench_model)
    offline = commands.add_parser("bench-offline", help="offline throughput through the engine (LLM.generate)")
    offline.add_argument("-c", "--config", metavar="SPEC", help="the spec (default: every default)")
    offline.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    offline.add_argument("--requests", type=int, default=64)
    offline.add_argument("--input-len", type=int, default=256)
    offline.add_argument("--output-len", type=int, default=128)
    offline.set_defaults(run=_bench_offline)
    docs = commands.add_parser("spec-docs", help="print docs/SPEC.md, generated from the spec's field docs")
    docs.set_defaults(run=_spec_docs)
    serve = commands.add_parser("serve", help="start the appliance: engine process and OpenAI-compatible HTTP server")
    serve.add_argument("-c", "--config", metavar="SPEC", help="the YAML spec (default: every default)")
    serve.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec value")
    serve.set_defaults(run=_serve)
    topo = commands.add_parser("topology", help="show the CPU/NUMA/cgroup topology as the planner sees it")
    topo.add_argument("--root", default="/", help="read a captured tree instead of this machine")
    topo.add_argument("--json", action="store_true", help="JSON instead of text")
    topo.add_argument("--capture", metavar="DIR", help="copy the files the reader uses into DIR (for tests or bug reports)")
    topo.set_defaults(run=_topology)
    return parser


def _command(commands, name: str, run: Callable, help_text: str, extra: Callable) -> None:
    parser = commands.add_parser(name, help=help_text, description=help_text)
    parser.add_argument("-c", "--config", metavar="SPEC", help="the YAML spec (default: every default)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec value, e.g. --set parallel.tp=2 (repeatable)")
    if name != "preflight":
        parser.add_argument("--root", default="/", help="plan for a captured machine tree instead of this machine")
    extra(parser)
    parser.set_defaults(run=run)


def _context(args: argparse.Namespace) -> Context:
    doc = read_spec(args.config, args.set)
    try:
        topo = read_topology(getattr(args, "root", "/"))
        source = resolve_source(doc.spec.model)
        return Context(doc, topo, source, read_footprint(source, source_key(doc.spec.model)))
    except SpecError as error:
        raise doc.locate(error) from None


def _make_plan(ctx: Context):
    from app.bootstrap.preflight import check, default_search_dirs
    from app.placement.plan import make_plan

    # Which OpenMP runtime "auto" means depends on what is installed here, not on the captured tree.
    report = check(ctx.doc.spec.runtime, ctx.topo.arch, {}, default_search_dirs(), "")
    try:
        return make_plan(ctx.doc.spec, ctx.topo, ctx.model, report.openmp_runtime)
    except SpecError as error:
        raise ctx.doc.locate(error) from None


def _validate(args: argparse.Namespace) -> int:
    ctx = _context(args)
    plan = _make_plan(ctx)
    if args.print:
        print(dump_spec(ctx.doc.spec), end="")
    replicas = len({r.replica for r in plan.ranks})
    print(f"{ctx.doc.source}: OK: {ctx.source.served_name}, {replicas} replica(s) x "
          f"{len(plan.ranks) // replicas} TP rank(s), {plan.dtype}", file=sys.stderr)
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from app.placement.render import plan_json, plan_table

    ctx = _context(args)
    plan = _make_plan(ctx)
    render = plan_json if args.json else plan_table
    print(render(plan, ctx.source, ctx.model, ctx.topo))
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

    return serve(args.config, args.set)


def _bench_model(args: argparse.Namespace) -> int:
    from app.benchmark.model import run

    doc = read_spec(args.config, [])
    run(resolve_source(doc.spec.model), args.dtype or ["float32", "bfloat16"], args.batch or [1, 16], args.context,
        args.prompt, args.steps, args.chunk)
    return 0


def _bench_offline(args: argparse.Namespace) -> int:
    from app.benchmark.offline import run

    run(args.config, args.dtype, args.requests, args.input_len, args.output_len)
    return 0


def _spec_docs(args: argparse.Namespace) -> int:
    from app.spec.docs import spec_markdown

    print(spec_markdown(), end="")
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
