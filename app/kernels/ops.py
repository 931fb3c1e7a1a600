"""Python entry points of the native kernels: check every tensor, then hand pointers to app._native.

Float tensors are float32 or bfloat16 (kernels accumulate in float32); the last dimension must be
contiguous, rows may be strided. Errors are ValueError/TypeError naming the argument.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from app import _native

_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int32: 2, torch.int64: 3, torch.uint8: 4, torch.float16: 5}
FLOAT_DTYPES = (torch.float32, torch.bfloat16)
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # a KV cache's (float16: the cache only)


def _ref(t: torch.Tensor, name: str, dtypes: Sequence[torch.dtype] = FLOAT_DTYPES, dims: int | None = None) -> tuple:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name}: must be on the CPU, not {t.device}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype must be one of {', '.join(map(str, dtypes))}, not {t.dtype}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dimensions, got shape {tuple(t.shape)}")
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride {t.stride(-1)})")
    return t.data_ptr(), _CODES[t.dtype], list(t.shape), list(t.stride())


def _same_dtype(reference: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.dtype != reference.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from the input's {reference.dtype}")


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """[..., H] -> [T, H] without copying (a strided row view), or a clear error."""
    if x.dim() < 1:
        raise ValueError(f"{name}: expected at least one dimension")
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name}: its leading dimensions cannot be flattened without a copy") from None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    # x: [..., H], weight: [H] -> [..., H]
    _same_dtype(x, weight=weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    _same_dtype(x, out=out)
    _native.rms_norm(_ref(_rows(out, "out"), "out"), _ref(_rows(x, "x"), "x"), _ref(weight, "weight", dims=1), eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    # in place: residual += x; x = rms_norm(residual) * weight.  x, residual: [..., H]
    _same_dtype(x, residual=residual, weight=weight)
    _native.add_rms_norm(_ref(_rows(x, "x"), "x"), _ref(_rows(residual, "residual"), "residual"),
                         _ref(weight, "weight", dims=1), eps)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
                     head_dim: int) -> None:
    # in place, NeoX layout. positions: [T] int64; q: [T, Hq*D]; k: [T, Hk*D]; cos_sin: [P, rot] float32
    _same_dtype(q, k=k)
    q3, k3 = _heads(q, head_dim, "q"), _heads(k, head_dim, "k")
    _native.rotary_embedding(_ref(positions, "positions", (torch.int64,), 1), _ref(q3, "q", dims=3),
                             _ref(k3, "k", dims=3), _ref(cos_sin, "cos_sin", (torch.float32,), 2))


def _heads(x: torch.Tensor, head_dim: int, name: str) -> torch.Tensor:
    """[T, H*D] -> [T, H, D] as a view."""
    if x.dim() != 2 or x.shape[1] % head_dim:
        raise ValueError(f"{name}: expected [tokens, heads * {head_dim}], got shape {tuple(x.shape)}")
    return x.view(x.shape[0], -1, head_dim)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # x: [T, 2I] -> silu(x[:, :I]) * x[:, I:]: [T, I]
    rows = _rows(x, "x")
    if rows.shape[1] % 2:
        raise ValueError(f"x: the last dimension must be even (gate and up halves), got {rows.shape[1]}")
    out = x.new_empty(*x.shape[:-1], rows.shape[1] // 2) if out is None else out
    _same_dtype(x, out=out)
    _native.silu_and_mul(_ref(_rows(out, "out"), "out"), _ref(rows, "x"))
    return out


def kv_cache_from_blocks(keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged cache holding keys and values: [blocks, Hk, block_size, D] each, in token order.

    The cache's own order within a (block, KV head) is the one its kernels read without transposing
    (native/src/cache.cpp): float32 and float16 keys [D, block_size], values [block_size, D]; bfloat16 the same with
    neighbours paired, keys [D/2, block_size, 2], values [block_size/2, D, 2]. Shapes stay
    [blocks, Hk, D, block_size] and [blocks, Hk, block_size, D]; index a cache only through these two helpers.
    """
    n, h, b, d = values.shape
    keys, values = keys.to(dtype), values.to(dtype)
    if dtype != torch.bfloat16:
        return keys.transpose(2, 3).contiguous(), values.contiguous()
    return (keys.reshape(n, h, b, d // 2, 2).permute(0, 1, 3, 2, 4).reshape(n, h, d, b).contiguous(),
            values.reshape(n, h, b // 2, 2, d).permute(0, 1, 2, 4, 3).reshape(n, h, b, d).contiguous())


def kv_cache_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of kv_cache_from_blocks: keys and values [blocks, Hk, block_size, D] in token order."""
    n, h, b, d = value_cache.shape
    if value_cache.dtype != torch.bfloat16:
        return key_cache.transpose(2, 3), value_cache
    return (key_cache.reshape(n, h, d // 2, b, 2).permute(0, 1, 3, 2, 4).reshape(n, h, b, d),
            value_cache.reshape(n, h, b // 2, d, 2).permute(0, 1, 2, 4, 3).reshape(n, h, b, d))


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    # key, value: [T, Hk, D]; key_cache: [blocks, Hk, D, block_size], value_cache: [blocks, Hk, block_size, D],
    # each in the order kv_cache_from_blocks gives; slot_mapping: [T] int64 (-1: skip).
    # The caches may be bfloat16 or float16 for float32 keys and values (rounded to nearest even as they are written;
    # float16 saturates at +-65,504, where rounding would give infinity).
    _same_dtype(key, value=value)
    _same_dtype(key_cache, value_cache=value_cache)
    _native.write_kv_cache(_ref(key, "key", dims=3), _ref(value, "value", dims=3),
                           _ref(key_cache, "key_cache", CACHE_DTYPES, 4),
                           _ref(value_cache, "value_cache", CACHE_DTYPES, 4),
                           _ref(slot_mapping, "slot_mapping", (torch.int64,), 1))


def touch_kv_blocks(caches: Sequence[tuple[torch.Tensor, torch.Tensor]], first: int, last: int) -> None:
    # caches: every layer's (key_cache, value_cache) as write_kv_cache takes them. Write-faults the pages of blocks
    # [first, last) without changing a byte (safe beside a step that writes them); the GIL is released meanwhile.
    _native.touch_kv_blocks([(_ref(k, "key_cache", CACHE_DTYPES, 4), _ref(v, "value_cache", CACHE_DTYPES, 4))
                             for k, v in caches], first, last)


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, q_starts: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    # q: [Tq, Hq, D], the new tokens of every sequence back to back (q_starts: [S+1] int64 offsets);
    # each attends causally to all context_lens[s] cached tokens of its sequence. Returns [Tq, Hq, D].
    # The caches may have another float dtype than q (a bfloat16 or float16 cache for float32 activations).
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    _same_dtype(q, out=out)
    _same_dtype(key_cache, value_cache=value_cache)
    _native.paged_attention(_ref(out, "out", dims=3), _ref(q, "q", dims=3),
                            _ref(key_cache, "key_cache", CACHE_DTYPES, 4),
                            _ref(value_cache, "value_cache", CACHE_DTYPES, 4),
                            _ref(block_tables, "block_tables", (torch.int32,), 2),
                            _ref(context_lens, "context_lens", (torch.int32,), 1),
                            _ref(q_starts, "q_starts", (torch.int64,), 1), float(scale))
    return out


def linear_f32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x: [S, K], weight: [V, K] (same dtype) -> x @ weight.T as float32 [S, V], accumulated in float32
    _same_dtype(x, weight=weight)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _native.linear_f32_out(_ref(out, "out", (torch.float32,), 2), _ref(x, "x", dims=2), _ref(weight, "weight", dims=2))
    return out


def pack_quant(weight: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    # weight: [V, K/32 blocks] uint8 of type `qtype` (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, BF16 30, or
    # convert_quant's Q4_M32 100, Q8_M32 101, Q8_H32 102, IQ4_F32 103, Q4_HM32 104; IQ4_NL 20), or
    # [V, K/256 superblocks] of Q2_K 10 to Q6_K 14, IQ4_XS 23
    # -> the packed layout, uint8 [bytes]
    out = torch.empty(_native.packed_bytes(int(qtype), weight.shape[0], int(in_features)), dtype=torch.uint8)
    _native.pack_quant(_ref(out, "out", (torch.uint8,), 1), _ref(weight, "weight", (torch.uint8,), 2), int(qtype),
                       int(in_features))
    return out


def packed_linear(x: torch.Tensor, weight: torch.Tensor, qtype: int, in_features: int, out_features: int,
                  activations: int, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                  prompt: bool = False) -> torch.Tensor:
    # x: [..., K] float; weight: packed [V, K] (pack_quant) -> x @ W^T: [..., V] in out_dtype (default x's),
    # accumulated in float32; activations: 0 float32 FMAs, 1 int8 per block of 32, 2 int16 (two int8 planes).
    # out: [rows of x, V] to write into (rows at any stride: some columns of a wider output), or None.
    # prompt: x's rows are prompt tokens: under int16, float32 FMAs on widened weights where `widens_prompts(qtype)`
    rows = _rows(x, "x")
    if out is not None and out_dtype is not None and out.dtype != out_dtype:
        raise TypeError(f"out: dtype {out.dtype} differs from out_dtype {out_dtype}")
    target = torch.empty(rows.shape[0], out_features, dtype=out_dtype or x.dtype) if out is None else out
    _native.packed_linear(_ref(target, "out", dims=2), _ref(rows, "x", dims=2), _ref(weight, "weight", (torch.uint8,), 1),
                          int(qtype), int(in_features), int(out_features), int(activations), bool(prompt))
    return target.view(*x.shape[:-1], out_features) if out is None else out


def packed_rows(weight: torch.Tensor, ids: torch.Tensor, qtype: int, in_features: int, out_features: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # weight: packed [V, K]; ids: [N] int64 rows -> those rows dequantized: [N, K] in dtype
    out = torch.empty(ids.shape[0], in_features, dtype=dtype)
    _native.packed_rows(_ref(out, "out", dims=2), _ref(weight, "weight", (torch.uint8,), 1),
                        _ref(ids, "ids", (torch.int64,), 1), int(qtype), int(in_features), int(out_features))
    return out


def convert_quant(weight: torch.Tensor, file_type: int, in_features: int) -> tuple[torch.Tensor, int]:
    # weight: [R, file blocks] uint8 of GGML type `file_type` (Q5_0 6, Q5_1 7, Q2_K 10 to Q6_K 14, IQ4_XS 23) ->
    # (the same weights as exact blocks of 32 a packed type runs, uint8 [R, K/32 blocks]; that type's id)
    qtype = _native.converted_type(int(file_type))
    out = torch.empty(weight.shape[0], in_features // 32 * _native.block_bytes(qtype), dtype=torch.uint8)
    _native.convert_quant(_ref(out, "out", (torch.uint8,), 2), _ref(weight, "weight", (torch.uint8,), 2),
                          int(file_type), int(in_features))
    return out, qtype


def dequantize(weight: torch.Tensor, qtype: int, in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # weight: [R, K/32 GGUF blocks] (K/256 for Q2_K to Q6_K and IQ4_XS) uint8 -> [R, K] in dtype
    out = torch.empty(weight.shape[0], in_features, dtype=dtype)
    _native.dequantize(_ref(out, "out", dims=2), _ref(weight, "weight", (torch.uint8,), 2), int(qtype), int(in_features))
    return out


def bind_threads(cpus: Sequence[int], nodes: Sequence[int] = (), interleave: bool = False) -> str:
    """Pin OpenMP thread i to cpus[i], bind memory to `nodes`; returns a report of what was bound."""
    report = _native.bind_threads(list(cpus), list(nodes), interleave)
    torch.set_num_threads(len(cpus))  # torch shares the OpenMP pool; keep its idea of the size in step
    return report


def memory_nodes() -> tuple[int, ...] | None:
    """The NUMA nodes the calling thread's memory policy confines its new pages to (bind_threads' binding, an
    interleave, or numactl's); None where any node will do."""
    return tuple(_native.memory_nodes()) or None


def isa() -> str:
    """The ISA whose kernels run now ("avx512bf16", "avx512", "avx2", "neon" or "portable")."""
    return _native.isa()


def widens_prompts(qtype: int | None = None) -> bool:
    """Whether these kernels run int16 prompt rows of packed type `qtype` (None: of any type) as float32 FMAs on
    weights widened to float32, exact as the reference's products: AVX2, where that is faster than its integer
    multiplies (native/src/widened.cpp), except, where those multiplies are cheap (`wide_int_tiles`), the types
    with one scale a block, whose rows beyond a few run as 16-bit words (native/include/packed.h, expands_words)."""
    return _native.widens_prompts(qtype)


def compiled_isas() -> list[str]:
    return _native.compiled_isas()


def supported_isas() -> list[str]:
    """The compiled ISAs this CPU can run, best first."""
    compiled = _native.compiled_isas()
    return compiled[compiled.index(_native.best_isa()):]


@contextmanager
def _switched(current: Callable[[], str], select: Callable[[str], None], value: str) -> Iterator[None]:
    """`select(value)` inside the block, then back to what `current()` was."""
    previous = current()
    select(value)
    try:
        yield
    finally:
        select(previous)


def use_isa(name: str) -> AbstractContextManager[None]:
    """Run the kernels of ISA `name` inside the block (tests compare ISAs this way)."""
    return _switched(_native.isa, _native.select_isa, name)


def bf16_dot() -> bool:
    """Whether the avx512bf16 kernels multiply bfloat16 pairs with vdpbf16ps (attention against a bfloat16
    cache, BF16 weights times bfloat16 activations) rather than float32 FMAs; see `bf16_dot_ratio`."""
    return _native.bf16_dot()


def bf16_dot_ratio() -> float:
    """vdpbf16ps' issue rate over vfmadd231ps', measured once per process (0.0 without AVX512-BF16). It makes
    twice the products an instruction, so from 0.5 up it is the faster of the two (`bf16_dot` under "auto")."""
    return _native.bf16_dot_ratio()


def use_bf16_dot(mode: str) -> AbstractContextManager[None]:
    """Inside the block, "on" / "off" force vdpbf16ps or the FMAs, "auto" measures (tests compare both)."""
    return _switched(_native.bf16_dot_mode, _native.set_bf16_dot, mode)


def wide_int_tiles() -> bool:
    """Whether the avx2 kernels' int16 row tiles take several rows (where integer multiplies are cheap) rather
    than one (where the multiplier limits them); see `int_mul_ratio`. The same bits either way."""
    return _native.wide_int_tiles()


def int_mul_ratio() -> float:
    """vpmaddubsw's ymm issue rate over vfmadd231ps', measured once per process (0.0 without the avx2 kernels):
    ~0.5 where a 256-bit multiply takes two halves through one pipe (AMD Zen 1), ~1 on AMD Zen 3. From 0.75 up
    the int16 row tiles take several rows (`wide_int_tiles` under "auto")."""
    return _native.int_mul_ratio()


def use_int_tiles(mode: str) -> AbstractContextManager[None]:
    """Inside the block, "narrow" / "wide" force the avx2 int16 row tiles' shape, "auto" measures (tests compare)."""
    return _switched(_native.int_tiles_mode, _native.set_int_tiles, mode)


def describe() -> str:
    """The kernels in use, for logs: the ISA and, with AVX512-BF16, how bfloat16 pairs are multiplied."""
    name = _native.isa()
    if _native.widens_prompts():
        ratio = f"vpmaddubsw issues at {_native.int_mul_ratio():.2f}x an FMA's rate here"
        if not _native.wide_int_tiles():
            return f"{name} (int16 prompt rows on float32 FMAs, weights widened; narrow int16 row tiles: {ratio})"
        return (f"{name} (int16 rows beyond 4 as 16-bit words where a type has one scale a block; other types' "
                f"prompt rows on float32 FMAs, weights widened; wide int16 row tiles: {ratio})")
    if name != "avx512bf16":
        return name
    ratio = _native.bf16_dot_ratio()
    how = "vdpbf16ps" if _native.bf16_dot() else "float32 FMAs"
    return (f"{name} (bfloat16 pairs on {how}; vdpbf16ps issues at {ratio:.2f}x an FMA's rate here; "
            f"AMX-INT8 tiles for int16 row chunks: {amx_status()})")


def amx_status() -> str:
    """Whether int16 row chunks of 16 rows and more (of the types with one scale a block: Q4_0, Q4_1, Q8_0, Q4_K, the
    Q5 types) run on AMX-INT8's tile multiplies: "in use", "off", "emulated in software (tests)", or (under "auto")
    why not, e.g. "the CPU has no AMX-TILE and AMX-INT8". The first call under "auto" on an AMX CPU checks the CPU's
    multiplies against the emulated ones."""
    return _native.amx_status()


def amx_row_chunks() -> int:
    """How many row chunks of a panel pair the emulated AMX rows took in this process (tests: that they ran; the CPU's
    own AMX rows are not counted, so that the hot path touches no shared counter)."""
    return _native.amx_row_chunks()


def use_amx_tiles(mode: str) -> AbstractContextManager[None]:
    """Inside the block, "off" keeps int16 row chunks on the vector tiles, "emulated" runs the AMX tiles' algorithm
    with multiplies in software on any x86 CPU (tests compare it with the vector tiles), "auto" uses the CPU's."""
    return _switched(_native.amx_tiles_mode, _native.set_amx_tiles, mode)


Parts = list[tuple[torch.Tensor, int, int]]  # a packed linear's parts: (uint8 data, type id, rows)


@dataclass(frozen=True)
class Experts:
    """A layer's mixture of experts for DecoderStack.add_layer: the router [experts, hidden] in the activation
    dtype, each expert's gate/up and down parts, how many experts a token takes, and whether their weights are
    rescaled to sum to 1."""

    router: torch.Tensor
    gate_up: list[Parts]
    down: list[Parts]
    top_k: int
    renormalize: bool


class DecoderStack:
    """A Llama-family layer stack run in one native call a step (native/include/decoder.h): kept-quantized
    linears with quantized activations, on this rank's heads; `group` is the native tensor-parallel group
    (app.parallel.group.ShmGroup) or None. The caller keeps every tensor it hands over alive."""

    def __init__(self, dtype: torch.dtype, activations: int, hidden: int, q_heads: int, kv_heads: int, head_dim: int,
                 inter: int, eps: float, scale: float, cos_sin: torch.Tensor, final_norm: torch.Tensor, group=None):
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {', '.join(map(str, FLOAT_DTYPES))}, not {dtype}")
        self._stack = _native.DecoderStack(_CODES[dtype], int(activations), hidden, q_heads, kv_heads, head_dim, inter,
                                           float(eps), float(scale), _ref(cos_sin, "cos_sin", (torch.float32,), 2),
                                           _ref(final_norm, "final_norm", dims=1), group)

    def add_layer(self, qkv: Parts, o: Parts, gate_up: Parts, down: Parts, input_norm: torch.Tensor,
                  post_norm: torch.Tensor, qkv_bias: torch.Tensor | None, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None, experts: Experts | None = None) -> None:
        # each linear: its parts, (packed uint8 data, type id, rows) each, stacked by rows (one part but for a
        # fused projection whose parts differ in type); caches as write_kv_cache takes them; q_norm and k_norm
        # [head_dim] (Qwen3's per-head norms, both or neither); experts in place of the MLP (gate_up and down
        # then empty)
        def packed(parts, name):
            return [(_ref(data, name, (torch.uint8,), 1), int(qtype), int(rows)) for data, qtype, rows in parts]

        mixture = {}
        if experts is not None:
            mixture = dict(router=_ref(experts.router, "router", dims=2),
                           experts_gate_up=[packed(p, "expert gate_up") for p in experts.gate_up],
                           experts_down=[packed(p, "expert down") for p in experts.down],
                           top_k=experts.top_k, renormalize=experts.renormalize)

        self._stack.add_layer(packed(qkv, "qkv"), packed(o, "o"), packed(gate_up, "gate_up"), packed(down, "down"),
                              _ref(input_norm, "input_norm", dims=1), _ref(post_norm, "post_norm", dims=1),
                              None if qkv_bias is None else _ref(qkv_bias, "qkv_bias", dims=1),
                              _ref(key_cache, "key_cache", CACHE_DTYPES, 4),
                              _ref(value_cache, "value_cache", CACHE_DTYPES, 4),
                              None if q_norm is None else _ref(q_norm, "q_norm", dims=1),
                              None if k_norm is None else _ref(k_norm, "k_norm", dims=1), **mixture)

    def run(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor, q_starts: torch.Tensor, prompt_rows: torch.Tensor,
            hidden_rows: torch.Tensor | None = None) -> None:
        # in place: x [T, hidden] embeddings -> the final hidden states (after the model's last norm);
        # prompt_rows [S]: how many of each sequence's rows (its first) are prompt tokens; hidden_rows [S] (None:
        # all): how many of each one's rows (its last) get their final hidden state (the others' are left as they
        # are: the last layer computes only their keys and values)
        self._stack.run(_ref(x, "x", dims=2), _ref(positions, "positions", (torch.int64,), 1),
                        _ref(slot_mapping, "slot_mapping", (torch.int64,), 1),
                        _ref(block_tables, "block_tables", (torch.int32,), 2),
                        _ref(context_lens, "context_lens", (torch.int32,), 1), _ref(q_starts, "q_starts", (torch.int64,), 1),
                        _ref(prompt_rows, "prompt_rows", (torch.int64,), 1),
                        None if hidden_rows is None else _ref(hidden_rows, "hidden_rows", (torch.int64,), 1))
