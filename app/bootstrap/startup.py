"""The one start sequence: spec -> topology -> model source -> footprint -> plan.

`validate`, `plan`, `serve` and the offline `LLM` all begin here, so they agree on what a spec
means on this machine. Every SpecError on the way is located in the YAML (file, line, key).
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from app.engine.launch import ModelLaunch, Placement, RankLaunch
from app.model.footprint import ModelFootprint
from app.model.source import ModelSource
from app.placement.plan import Plan
from app.spec.load import SpecDocument
from app.spec.schema import Spec
from app.topology.machine import Topology

# Given the spec and the machine, the OpenMP runtime "auto" resolves to (what is installed here).
OpenMPProbe = Callable[[Spec, Topology], str]


@dataclass(frozen=True)
class Deployment:
    doc: SpecDocument
    topology: Topology
    source: ModelSource
    footprint: ModelFootprint
    plan: Plan

    @property
    def spec(self) -> Spec:
        return self.doc.spec

    def chat_template(self) -> str | None:
        """The spec's chat template override (a file's contents, or the template itself); None: the model's."""
        return chat_template_text(self.spec.model.chat_template)

    def pooling(self) -> str:
        """How embeddings pool the final hidden states: the spec's model.pooling, or where "auto" the model's."""
        chosen = self.spec.model.pooling
        return self.footprint.pooling if chosen == "auto" else chosen

    @cached_property
    def sampling_defaults(self) -> tuple[dict[str, float | int], str]:
        """The defaults of the sampling fields a request leaves out, and where they came from (for the log): the
        model's own (model.generation_config: auto) with model.sampling_defaults over them."""
        from app.model.generation_config import model_sampling_defaults

        model = self.spec.model
        found, where = model_sampling_defaults(self.source) if model.generation_config == "auto" else ({}, "")
        own = model.sampling_defaults.model_dump(exclude_none=True) if model.sampling_defaults else {}
        sources = [text for text, given in ((f"the model's {where}", found), ("model.sampling_defaults", own))
                   if given]
        return {**found, **own}, " over ".join(reversed(sources))

    def launches(self, sockets: Path | None = None) -> list[RankLaunch]:
        """One launch record per rank of every replica, in plan order; `sockets` is where rank 0s bind."""
        from app.cache import cache_root
        from app.engine.kv_cache import KVCacheConfig
        from app.engine.scheduler import SchedulerConfig

        spec, plan = self.spec, self.plan
        sched = spec.scheduler
        model = ModelLaunch(str(self.source.path), self.source.format, self.source.served_name, plan.dtype,
                            spec.model.quantized, spec.model.quantized_activations)
        scheduler = SchedulerConfig(sched.max_num_seqs, sched.max_num_batched_tokens, plan.max_model_len,
                                    sched.chunked_prefill, sched.step_time_budget, sched.speculative.config())
        tp = spec.parallel.tp
        cache = cache_root()
        records = []
        for rank in plan.ranks:
            # a replica's ranks share one block table: its smallest rank's cache sets the count
            blocks = min(r.kv_blocks for r in plan.ranks if r.replica == rank.replica)
            kv = KVCacheConfig(blocks, plan.block_size, plan.kv_dtype, sched.prefix_caching)
            placement = Placement(rank.cpus, rank.memory_nodes, rank.memory_policy == "interleave", rank.openmp_env)
            address = f"ipc://{sockets}/engine-{rank.replica}.ipc" if sockets is not None and rank.rank == 0 else ""
            records.append(RankLaunch(rank.replica, rank.rank, tp, placement, model, kv, scheduler, address,
                                      sched.max_waiting_requests, spec.runtime.log_level, spec.runtime.log_format,
                                      str(cache or "")))
        return records


def prepare(config: str | Path | None, overrides: list[str], *, root: str | Path = "/",
            openmp: OpenMPProbe | None = None) -> Deployment:
    """Read the spec and the machine and plan. `openmp` resolves runtime "auto" (default: look at what is
    installed, without re-executing); `serve` passes its preflight, which may re-execute the process first."""
    from app.model.footprint import read_footprint
    from app.model.source import resolve_source, source_key
    from app.placement.plan import make_plan
    from app.spec.errors import SpecError
    from app.spec.load import read_spec
    from app.topology.machine import read_topology

    doc = read_spec(config, overrides)
    try:
        chat_template_text(doc.spec.model.chat_template)  # (checked before anything else is read)
        topo = read_topology(root)
        runtime = (openmp or installed_openmp)(doc.spec, topo)
        source = resolve_source(doc.spec.model)
        footprint = read_footprint(source, source_key(doc.spec.model))
        plan = make_plan(doc.spec, topo, footprint, runtime)
    except SpecError as error:
        raise doc.locate(error) from None
    return Deployment(doc, topo, source, footprint, plan)


def installed_openmp(spec: Spec, topo: Topology) -> str:
    """The OpenMP runtime "auto" means here: what is installed on this machine (even for a captured tree)."""
    from app.bootstrap.preflight import check, default_search_dirs

    return check(spec.runtime, topo.arch, {}, default_search_dirs(), "").openmp_runtime


def chat_template_text(override: str | None) -> str | None:
    """model.chat_template's template: a file's text, or the value itself (None: the model's own). SpecError where it
    names no file and holds no Jinja (a mistyped path would otherwise be every chat prompt's text), or where the
    template does not compile (every chat request would be refused); compiled as transformers does, which caches it."""
    from app.spec.errors import Described, Problem, SpecError

    if override is None:
        return None
    if template_file(override):
        try:
            text = Path(override).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecError([Problem("model.chat_template", "a readable Jinja file, or the template's text",
                                     Described(f"{override} ({exc})"))]) from None
    elif not any(mark in override for mark in ("{{", "{%", "{#")):
        raise SpecError([Problem("model.chat_template",
                                 "a path to an existing Jinja file, or the template's text (with {{ }} or {% %})",
                                 Described(f"{override!r}, which is no file and no template"))])
    else:
        text = override
    try:
        _compile_template(text)
    except Exception as exc:  # jinja2's TemplateSyntaxError (or what else its parser raises)
        line = getattr(exc, "lineno", None)
        where = f" (line {line})" if line else ""
        raise SpecError([Problem("model.chat_template", "a Jinja template that compiles",
                                 Described(f"a template with an error: {exc}{where}"))]) from None
    return text


def template_file(override: str) -> bool:
    """Whether model.chat_template names a file: a template's text can be no path at all (Path.is_file raises on a
    name over 255 bytes, or a NUL), so whatever the OS cannot look up is text."""
    try:
        return os.path.isfile(override)
    except (OSError, ValueError):
        return False


def _compile_template(text: str) -> None:
    """Compile as transformers' apply_chat_template does (its sandbox and extensions), else with jinja2's sandbox."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a private helper of transformers: where it is gone, jinja2's parser checks the syntax
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment(extensions=[loopcontrols]).parse(text)
        return
    _compile_jinja_template(text)


def api_key(spec) -> str | None:
    """The key itself, from the spec (server.api_key), a file or the environment (the bootstrap reads those)."""
    from app.spec.errors import Described, Problem, SpecError

    if spec is None:
        return None
    if spec.value is not None:
        return spec.value
    if spec.file is not None:
        try:
            return Path(spec.file).read_text().strip()
        except OSError as exc:
            raise SpecError([Problem("server.api_key.file", "a readable file holding the key",
                                     Described(f"{spec.file} ({exc.strerror})"))]) from None
    value = os.environ.get(spec.env)
    if not value:
        raise SpecError([Problem("server.api_key.env", "the name of a set, non-empty environment variable",
                                 Described(f"{spec.env}, which is not set"))])
    return value


def check_listen(host: str, port: int) -> None:
    """SpecError on server.host or server.port where the HTTP frontend could not listen there: checked before the
    model loads (gunicorn would find out after, and retry for seconds). Bound as gunicorn binds: an IPv6 literal
    as IPv6, anything else (a name too) as IPv4. Port 0: the host alone (`validate`)."""
    from app.spec.errors import Described, Problem, SpecError

    def problem(key: str, allowed: str, found: str) -> SpecError:
        return SpecError([Problem(f"server.{key}", allowed, Described(found))])

    try:
        with socket.socket(socket.AF_INET6 if is_ipv6(host) else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gunicorn binds
            probe.bind((host, port))
    except (socket.gaierror, UnicodeError) as exc:
        raise problem("host", "an address or host name of this machine", f"{host!r}, which does not resolve "
                      f"({exc})") from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise problem("port", "a port no other process listens on", f"{port}, already in use on {host}") \
                from None
        if exc.errno == errno.EACCES:
            raise problem("port", "a port this process may listen on (from 1024 unless root)",
                          f"{port} ({exc.strerror})") from None
        raise problem("host", "an address of this machine to listen on", f"{host!r} ({exc.strerror})") from None


def is_ipv6(host: str) -> bool:
    """Whether `host` is an IPv6 address (gunicorn binds those as IPv6, and wants them in brackets)."""
    try:
        socket.inet_pton(socket.AF_INET6, host)
        return True
    except (OSError, ValueError):
        return False


def bind_address(host: str, port: int) -> str:
    """gunicorn's --bind for this host and port: an IPv6 address in brackets ("[::]:8000")."""
    return f"[{host}]:{port}" if is_ipv6(host) else f"{host}:{port}"
