"""Each native kernel against a plain torch reference, on odd sizes, strided rows and both dtypes.

Every test runs once per ISA this CPU supports (avx512bf16, avx512, avx2, portable here), so the
portable path is checked against the same references as the AVX-512 one.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from app import _native, kernels
from tests.kernels.isas import running, variants

ISAS = kernels.supported_isas()
DTYPES = [torch.float32, torch.bfloat16]
# float32: summation order only; bfloat16: one rounding of the output (8 bits of mantissa)
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}


@pytest.fixture(params=variants())
def isa(request):
    with running(request.param):
        yield request.param


def strided(rows: int, cols: int, dtype: torch.dtype, pad: int = 19) -> torch.Tensor:
    """A [rows, cols] view whose rows are `pad` elements apart more than contiguous ones."""
    return torch.randn(rows, cols + pad, dtype=torch.float32).to(dtype)[:, :cols]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


# --- RMSNorm ------------------------------------------------------------------------------------


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 576), (7, 4096 + 13), (33, 5)])
def test_rms_norm(isa, dtype, tokens, hidden):
    x, w = strided(tokens, hidden, dtype), torch.randn(hidden).to(dtype)
    assert tokens == 1 or not x.is_contiguous()
    assert_close(kernels.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(isa, dtype):
    tokens, hidden = 9, 4096 + 13
    x, res, w = strided(tokens, hidden, dtype), strided(tokens, hidden, dtype, pad=3), torch.randn(hidden).to(dtype)
    expected_res = (x.float() + res.float()).to(dtype)
    expected_x = rms_norm_ref(expected_res, w, 1e-6)
    kernels.add_rms_norm(x, res, w, 1e-6)
    assert_close(res, expected_res, dtype)
    assert_close(x, expected_x, dtype)


# --- rotary embedding -----------------------------------------------------------------------------


def cos_sin_table(positions: int, rot: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def rope_ref(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, head_dim: int) -> torch.Tensor:
    t, rot = x.shape[0], table.shape[1]
    h = x.float().view(t, -1, head_dim).clone()
    cos, sin = table[positions, : rot // 2][:, None], table[positions, rot // 2:][:, None]
    x1, x2 = h[..., : rot // 2].clone(), h[..., rot // 2: rot].clone()
    h[..., : rot // 2], h[..., rot // 2: rot] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return h.view(t, -1).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_heads", "k_heads", "head_dim", "rot"), [(9, 3, 64, 64), (32, 8, 128, 128), (5, 5, 80, 40)])
def test_rotary_embedding(isa, dtype, q_heads, k_heads, head_dim, rot):
    tokens, table = 11, cos_sin_table(4096, rot)
    positions = torch.randint(0, 4096, (tokens,), dtype=torch.int64)
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim).to(dtype)  # q and k are strided views of it
    q, k = qkv[:, : q_heads * head_dim], qkv[:, q_heads * head_dim: (q_heads + k_heads) * head_dim]
    expected_q, expected_k = rope_ref(q, positions, table, head_dim), rope_ref(k, positions, table, head_dim)
    kernels.rotary_embedding(positions, q, k, table, head_dim)
    assert_close(q, expected_q, dtype)
    assert_close(k, expected_k, dtype)


# --- SwiGLU ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "inter"), [(1, 1536), (6, 4096 + 13), (3, 3)])
def test_silu_and_mul(isa, dtype, tokens, inter):
    x = strided(tokens, 2 * inter, dtype) * 4  # reach the saturated ends of the sigmoid
    expected = (F.silu(x[:, :inter].float()) * x[:, inter:].float()).to(dtype)
    assert_close(kernels.silu_and_mul(x), expected, dtype)


# --- paged KV cache and attention -----------------------------------------------------------------


def make_cache(blocks: int, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype):
    """Random keys and values in the cache's own order within a block (kernels.kv_cache_from_blocks)."""
    keys, values = torch.randn(blocks, kv_heads, block_size, head_dim), torch.randn(blocks, kv_heads, block_size, head_dim)
    return kernels.kv_cache_from_blocks(keys, values, dtype)


def test_cache_layout_helpers_invert_each_other():
    keys, values = torch.randn(3, 2, 8, 6), torch.randn(3, 2, 8, 6)
    for dtype in DTYPES:
        kc, vc = kernels.kv_cache_from_blocks(keys, values, dtype)
        assert kc.shape == (3, 2, 6, 8) and vc.shape == (3, 2, 8, 6)
        k, v = kernels.kv_cache_blocks(kc, vc)
        assert torch.equal(k, keys.to(dtype)) and torch.equal(v, values.to(dtype))
    kc, vc = kernels.kv_cache_from_blocks(keys, values, torch.bfloat16)  # features paired in keys, keys in values
    assert torch.equal(kc[1, 0].flatten()[:4], keys[1, 0, :2, :2].flatten().bfloat16())
    assert torch.equal(vc[1, 0].flatten()[:4], values[1, 0, :2, :2].T.flatten().bfloat16())


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache(isa, dtype):
    tokens, kv_heads, head_dim, block_size, blocks = 13, 3, 72, 16, 5
    kc, vc = make_cache(blocks, kv_heads, block_size, head_dim, dtype)
    kv = torch.randn(tokens, 2, kv_heads, head_dim).to(dtype)  # key and value interleaved: strided rows
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(blocks * block_size)[:tokens].to(torch.int64)
    slots[4] = -1  # a padding token writes nothing
    expected_k, expected_v = (t.clone() for t in kernels.kv_cache_blocks(kc, vc))
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, :, slot % block_size] = key[t]
            expected_v[slot // block_size, :, slot % block_size] = value[t]
    kernels.write_kv_cache(key, value, kc, vc, slots)
    k, v = kernels.kv_cache_blocks(kc, vc)
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)


def test_write_kv_cache_rounds_into_a_bfloat16_cache(isa):
    tokens, kv_heads, head_dim, block_size, blocks = 9, 3, 72, 16, 4
    kc, vc = make_cache(blocks, kv_heads, block_size, head_dim, torch.bfloat16)
    key, value = torch.randn(tokens, kv_heads, head_dim), torch.randn(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * block_size)[:tokens].to(torch.int64)
    kernels.write_kv_cache(key, value, kc, vc, slots)
    k, v = kernels.kv_cache_blocks(kc, vc)
    for t, slot in enumerate(slots.tolist()):  # round to nearest even, as torch's .to(bfloat16)
        assert torch.equal(k[slot // block_size, :, slot % block_size], key[t].to(torch.bfloat16))
        assert torch.equal(v[slot // block_size, :, slot % block_size], value[t].to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_rounds_into_a_float16_cache(isa, dtype):
    # float16 rounds to nearest even, as torch does: halfway cases both ways, subnormals (down to 2^-24 and below
    # half of it), the largest half (65,504), -0; but saturates: what torch rounds to infinity (65,520 on, and
    # infinities) is stored as +-65,504, since one infinite key or value makes NaN of every score or output it meets.
    # NaN stays NaN.
    # head_dim 75: the values' vector loop and its scalar tail on every ISA (keys are written one at a time)
    tokens, kv_heads, head_dim, block_size, blocks = 7, 3, 75, 16, 4
    kc, vc = make_cache(blocks, kv_heads, block_size, head_dim, torch.float16)
    key, value = torch.randn(tokens, kv_heads, head_dim) * 8, torch.randn(tokens, kv_heads, head_dim) / 8
    edges = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, 2 ** -24, 2 ** -25, 3 * 2 ** -26, 1e-30, 6.1e-5, 65504.,
                          65519., 65520., 1e6, float("inf"), -0.0, -3 * 2 ** -25, 2047.5, 4095., float("nan")])
    key[0, 0, :len(edges)], value[1, 2, -len(edges):] = edges, -edges  # the values' run into the scalar tail
    key[0, 1, :len(edges)], value[2, 0, :len(edges)] = -edges, edges  # both signs for both, the values' in vectors
    key, value = key.to(dtype), value.to(dtype)
    slots = torch.randperm(blocks * block_size)[:tokens].to(torch.int64)
    kernels.write_kv_cache(key, value, kc, vc, slots)
    k, v = kernels.kv_cache_blocks(kc, vc)

    def torch_with_saturation(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return torch.where(x.isnan(), x, x.clamp(-65504, 65504)).to(torch.float16)

    for t, slot in enumerate(slots.tolist()):  # exactly (NaN where NaN is expected)
        torch.testing.assert_close(k[slot // block_size, :, slot % block_size], torch_with_saturation(key[t]),
                                   rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v[slot // block_size, :, slot % block_size], torch_with_saturation(value[t]),
                                   rtol=0, atol=0, equal_nan=True)
    assert k.isinf().sum() == 0 and v.isinf().sum() == 0 and k.isnan().sum() == v.isnan().sum() == 2
    assert torch.equal(k[slots[0] // block_size, 0, slots[0] % block_size, 12].view(torch.int16), torch.tensor(-32768,
                       dtype=torch.int16))  # -0 stays -0


@pytest.mark.parametrize("q_dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 40])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 72)])
def test_attention_with_a_float16_cache(isa, q_dtype, block_size, q_heads, kv_heads, head_dim):
    # a float16 cache is read as float32 (widened as it is loaded): a whole prompt, an extend after cached tokens,
    # decodes on and off block boundaries, a sequence with no new tokens, never a slot past the context (NaN there),
    # and one sequence alone, whose keys split in ranges (split-KV); head_dim 72: P.V's scalar tail on AVX-512
    for context_lens, q_lens in (([300, 517, 64, 1, 129, 33], [300, 45, 1, 1, 1, 0]), ([1000], [1])):
        q, kc, vc, tables, lens, starts = attention_case(q_dtype, q_heads, kv_heads, head_dim, context_lens, q_lens,
                                                         block_size, seed=4)
        used = torch.zeros(kc.shape[0], block_size, dtype=torch.bool)
        for s, ctx in enumerate(context_lens):
            for pos in range(ctx):
                used[tables[s, pos // block_size], pos % block_size] = True
        keys, values = (t.clone().float() for t in kernels.kv_cache_blocks(kc, vc))
        keys[(~used)[:, None, :, None].expand_as(keys)] = float("nan")
        values[(~used)[:, None, :, None].expand_as(values)] = float("nan")
        kc, vc = kernels.kv_cache_from_blocks(keys, values, torch.float16)
        scale = head_dim ** -0.5
        out = kernels.paged_attention(q, kc, vc, tables, lens, starts, scale)
        assert out.dtype == q_dtype
        assert_close(out, attention_ref(q, kc, vc, tables, lens, q_lens, scale), q_dtype)


@pytest.mark.parametrize(("q_dtype", "cache_dtype"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                      (torch.float32, torch.float16), (torch.bfloat16, torch.float16)])
def test_attention_with_a_cache_of_another_dtype(isa, q_dtype, cache_dtype):
    context_lens, q_lens = [37, 100, 81, 250], [37, 29, 1, 1]  # prompt, extend, decodes
    q, kc, vc, tables, lens, starts = attention_case(q_dtype, 9, 3, 64, context_lens, q_lens, seed=3)
    kc, vc = kernels.kv_cache_from_blocks(*kernels.kv_cache_blocks(kc, vc), cache_dtype)
    out = kernels.paged_attention(q, kc, vc, tables, lens, starts, 0.125)
    assert out.dtype == q_dtype
    # against a bfloat16 cache, vdpbf16ps (AVX512-BF16) takes q and p rounded to bfloat16 too
    rounded = cache_dtype == torch.bfloat16 and isa == "avx512bf16"
    assert_close(out, attention_ref(q, kc, vc, tables, lens, q_lens, 0.125), torch.bfloat16 if rounded else q_dtype)


def attention_ref(q, kc, vc, tables, context_lens, q_lens, scale):
    """Gather each sequence's K/V from its blocks, then causal attention in float32."""
    outs, start = [], 0
    group = q.shape[1] // vc.shape[1]
    keys, values = kernels.kv_cache_blocks(kc, vc)  # [blocks, Hk, B, D] each
    for s, (ctx, q_len) in enumerate(zip(context_lens.tolist(), q_lens, strict=True)):
        blocks = tables[s, : math.ceil(ctx / vc.shape[2])].long()
        k = keys[blocks].float().transpose(1, 2).reshape(-1, vc.shape[1], vc.shape[3])[:ctx]
        v = values[blocks].float().transpose(1, 2).reshape(-1, vc.shape[1], vc.shape[3])[:ctx]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        qs = q[start: start + q_len].float()
        positions = torch.arange(ctx - q_len, ctx)[:, None]
        mask = torch.arange(ctx)[None, :] <= positions  # [q_len, ctx]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += q_len
    return torch.cat(outs).to(q.dtype)


def attention_case(dtype, q_heads, kv_heads, head_dim, context_lens, q_lens, block_size=16, seed=0):
    torch.manual_seed(seed)
    need = [math.ceil(c / block_size) for c in context_lens]
    blocks = sum(need) + 3
    kc, vc = make_cache(blocks, kv_heads, block_size, head_dim, dtype)
    order = torch.randperm(blocks).to(torch.int32)  # block tables point anywhere in the pool
    tables = torch.full((len(context_lens), max(need) + 2), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        tables[s, :n] = order[used: used + n]
        used += n
    q = torch.randn(sum(q_lens), q_heads, head_dim).to(dtype)
    q_starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int64)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return q, kc, vc, tables, lens, q_starts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(4, 4, 64), (9, 3, 64), (16, 2, 128), (8, 1, 72)])
def test_decode_attention(isa, dtype, q_heads, kv_heads, head_dim):
    context_lens = [1, 17, 33, 250, 64]  # ends mid-block, on a block boundary, and a single token
    q_lens = [1] * len(context_lens)
    q, kc, vc, tables, lens, starts = attention_case(dtype, q_heads, kv_heads, head_dim, context_lens, q_lens)
    scale = head_dim ** -0.5
    out = kernels.paged_attention(q, kc, vc, tables, lens, starts, scale)
    assert_close(out, attention_ref(q, kc, vc, tables, lens, q_lens, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_decode_attention(isa, dtype):
    # One or two sequences make too few items for the threads (fewer than two a thread, with 4 threads: 3 KV
    # heads a sequence): each item's keys are split in ranges whose partial results are merged (split-KV), its
    # KV heads kept together where the ranges alone are enough items (2,000 keys: 8 ranges), else one a head. The
    # slots for them are kept between calls, so calls of more, fewer and more ranges again each must match the
    # reference; so must a 16-token extend whose last range (key 256) only its last query sees, the other rows'
    # partials there empty, after calls that left other values in those slots.
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # the kernels read OpenMP's, which torch sets
    try:
        cases = [([1000], [1]), ([700, 300], [1, 1]), ([129], [1]), ([2000], [1]), ([257], [16]), ([1000], [1])]
        for seed, (context_lens, q_lens) in enumerate(cases):
            q, kc, vc, tables, lens, starts = attention_case(dtype, 9, 3, 64, context_lens, q_lens, seed=10 + seed)
            out = kernels.paged_attention(q, kc, vc, tables, lens, starts, 0.125)
            assert_close(out, attention_ref(q, kc, vc, tables, lens, q_lens, 0.125), dtype)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 128])
def test_a_rows_attention_is_the_same_bits_in_any_batch_and_chunk(isa, dtype, block_size):
    """Batch invariance: each sequence's rows, computed beside 7 others (items to spare: each walks its key ranges
    in turn) or alone (too few items for 4 threads: its ranges run as split-KV items), and a prompt's last 16
    queries computed as a chunk of their own, are the same bits; all of them the reference's, within rounding.
    (The split had depended on the step's item count, and a greedy answer on its neighbours.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        # alone, 2,100 keys split into ranges with their 3 KV heads together, 1,000 into ranges of one head each
        context_lens, q_lens = [700, 33, 1000, 300, 90, 520, 1, 257, 2100], [1, 1, 16, 1, 40, 1, 1, 5, 1]
        q, kc, vc, tables, lens, starts = attention_case(dtype, 9, 3, 64, context_lens, q_lens, block_size, seed=3)
        together = kernels.paged_attention(q, kc, vc, tables, lens, starts, 0.125)
        assert_close(together, attention_ref(q, kc, vc, tables, lens, q_lens, 0.125), dtype)
        for s, (a, b) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True)):
            alone = kernels.paged_attention(q[a:b], kc, vc, tables[s:s + 1], lens[s:s + 1],
                                            torch.tensor([0, b - a]), 0.125)
            assert torch.equal(alone, together[a:b]), s
            if b - a >= 16:
                tail = kernels.paged_attention(q[b - 16:b], kc, vc, tables[s:s + 1], lens[s:s + 1],
                                               torch.tensor([0, 16]), 0.125)
                assert torch.equal(tail, together[b - 16:b]), s
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(6, 6), (9, 3), (16, 2)])
def test_prefill_and_extend_attention(isa, dtype, q_heads, kv_heads):
    # a whole prompt, a chunk after a cached prefix (extend / chunked prefill), a decode, an odd tail
    context_lens, q_lens = [37, 100, 81, 19], [37, 29, 1, 19]
    q, kc, vc, tables, lens, starts = attention_case(dtype, q_heads, kv_heads, 64, context_lens, q_lens, seed=1)
    out = kernels.paged_attention(q, kc, vc, tables, lens, starts, 0.125)
    assert_close(out, attention_ref(q, kc, vc, tables, lens, q_lens, 0.125), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 24, 40, 72, 256])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 72)])
def test_attention_across_block_sizes(isa, dtype, block_size, q_heads, kv_heads, head_dim):
    # The kernel walks keys in tiles of whole blocks (several blocks of 8, one of 256) padded to the
    # vector width: a whole 300-token prompt over many tiles, a 45-token extend after 472 cached
    # tokens, decodes on and off a tile boundary, a single token, and a sequence with no new tokens.
    context_lens, q_lens = [300, 517, 64, 1, 129, 33], [300, 45, 1, 1, 1, 0]
    q, kc, vc, tables, lens, starts = attention_case(dtype, q_heads, kv_heads, head_dim, context_lens, q_lens,
                                                     block_size=block_size, seed=2)
    scale = head_dim ** -0.5
    out = kernels.paged_attention(q, kc, vc, tables, lens, starts, scale)
    assert_close(out, attention_ref(q, kc, vc, tables, lens, q_lens, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 48])
def test_attention_reads_no_cache_slot_past_the_context(isa, dtype, block_size):
    # odd context lengths: a bfloat16 cache pairs the last key's value with the never-written slot after it
    context_lens, q_lens = [70, 13, 37], [70, 2, 1]
    q, kc, vc, tables, lens, starts = attention_case(dtype, 9, 3, 64, context_lens, q_lens,
                                                     block_size=block_size, seed=3)
    used = torch.zeros(kc.shape[0], block_size, dtype=torch.bool)
    for s, ctx in enumerate(context_lens):
        for pos in range(ctx):
            used[tables[s, pos // block_size], pos % block_size] = True
    keys, values = (t.clone() for t in kernels.kv_cache_blocks(kc, vc))
    keys[(~used)[:, None, :, None].expand_as(keys)] = float("nan")  # a NaN read anywhere would reach the output
    values[(~used)[:, None, :, None].expand_as(values)] = float("nan")
    kc, vc = kernels.kv_cache_from_blocks(keys, values, dtype)
    out = kernels.paged_attention(q, kc, vc, tables, lens, starts, 0.125)
    assert_close(out, attention_ref(q, kc, vc, tables, lens, q_lens, 0.125), dtype)


def test_attention_with_strided_query_rows(isa):
    q, kc, vc, tables, lens, starts = attention_case(torch.float32, 9, 3, 64, [40, 9], [5, 9])
    wide = torch.randn(q.shape[0], 12, 64)
    wide[:, :9] = q
    view = wide[:, :9]  # rows 12 heads apart
    out = kernels.paged_attention(view, kc, vc, tables, lens, starts, 0.125)
    assert_close(out, attention_ref(q, kc, vc, tables, lens, [5, 9], 0.125), torch.float32)


def test_attention_refuses_sequences_that_do_not_fit_their_block_tables():
    q, kc, vc, tables, lens, starts = attention_case(torch.float32, 9, 3, 64, [40, 9], [5, 9])
    bad = tables.clone()
    bad[1, 0] = kc.shape[0]  # one past the pool
    with pytest.raises(ValueError, match=f"sequence 1 uses block {kc.shape[0]} outside the cache's {kc.shape[0]}"):
        kernels.paged_attention(q, kc, vc, bad, lens, starts, 0.125)
    with pytest.raises(ValueError, match="sequence 0: context is longer than its block table"):
        kernels.paged_attention(q, kc, vc, tables, torch.tensor([tables.shape[1] * 16 + 1, 9], dtype=torch.int32),
                                starts, 0.125)
    with pytest.raises(ValueError, match="sequence 1: more new tokens than context"):
        kernels.paged_attention(q, kc, vc, tables, torch.tensor([40, 8], dtype=torch.int32), starts, 0.125)


# --- every ISA agrees with the best one -------------------------------------------------------------


@pytest.mark.parametrize("other", [i for i in ISAS[1:]])
def test_slower_isas_match_the_best_one(other):
    q, kc, vc, tables, lens, starts = attention_case(torch.float32, 9, 3, 64, [70, 3, 129], [70, 1, 4])
    x, w = strided(5, 4096 + 13, torch.float32), torch.randn(4096 + 13)
    gate_up = strided(5, 2 * 1531, torch.float32)
    with kernels.use_isa(ISAS[0]):
        best = (kernels.paged_attention(q, kc, vc, tables, lens, starts, 0.1), kernels.rms_norm(x, w, 1e-5),
                kernels.silu_and_mul(gate_up))
    with kernels.use_isa(other):
        assert kernels.isa() == other
        mine = (kernels.paged_attention(q, kc, vc, tables, lens, starts, 0.1), kernels.rms_norm(x, w, 1e-5),
                kernels.silu_and_mul(gate_up))
    for a, b in zip(best, mine, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_portable_is_always_there_and_selection_is_restored():
    assert "portable" in kernels.compiled_isas() and ISAS[-1] == "portable"
    before = kernels.isa()
    with kernels.use_isa("portable"):
        assert kernels.isa() == "portable"
    assert kernels.isa() == before
    with pytest.raises(ValueError, match="not compiled in or not supported"):
        with kernels.use_isa("sse9"):
            pass


def test_bf16_dot_is_measured_and_can_be_forced():
    """vdpbf16ps or float32 FMAs for bfloat16 pairs: chosen from the two instructions' measured issue rates."""
    ratio = kernels.bf16_dot_ratio()
    if "avx512bf16" in ISAS:
        assert 0.05 < ratio < 8.0  # measured on this CPU (0.25 on an Intel Xeon, family 6 model 207)
        assert f"{ratio:.2f}x" in kernels.describe()
    else:
        assert ratio == 0.0 and kernels.describe().startswith(kernels.isa())
    assert ("prompt rows on float32 FMAs" in kernels.describe()) == kernels.widens_prompts()
    automatic = kernels.bf16_dot()
    assert automatic == (ratio >= 0.5)
    for mode, expected in (("on", True), ("off", False)):
        with kernels.use_bf16_dot(mode):
            assert kernels.bf16_dot() is expected
    assert kernels.bf16_dot() == automatic and _native.bf16_dot_mode() == "auto"  # restored
    with pytest.raises(ValueError, match="not one of auto, on, off"):
        with kernels.use_bf16_dot("fast"):
            pass


def test_bf16_dot_switches_between_float32_arithmetic_and_rounded_q_and_p():
    """With vdpbf16ps off, the avx512bf16 kernels do the avx512 ones' float32 arithmetic (attention on a
    bfloat16 cache, a BF16 linear on bfloat16 rows); on, q and p are rounded to bfloat16. On a CPU without
    AVX512-BF16 the switch changes nothing."""
    from app.model.quant import pack

    q, kc, vc, tables, lens, starts = attention_case(torch.float32, 9, 3, 64, [70, 3, 129], [70, 1, 4])
    kc, vc = kernels.kv_cache_from_blocks(*kernels.kv_cache_blocks(kc, vc), torch.bfloat16)
    packed = pack((torch.randn(67, 160) * 0.1).to(torch.bfloat16), "int16")
    x = torch.randn(9, 160).to(torch.bfloat16)

    def both():
        return kernels.paged_attention(q, kc, vc, tables, lens, starts, 0.1), packed.linear(x, torch.float32)

    if "avx512bf16" not in ISAS:
        with kernels.use_bf16_dot("off"):
            off = both()
        with kernels.use_bf16_dot("on"):
            on = both()
        assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])  # the same kernels run both times
        return
    with kernels.use_isa("avx512"):
        reference = both()
    with kernels.use_isa("avx512bf16"):
        with kernels.use_bf16_dot("off"):
            fmas = both()
        with kernels.use_bf16_dot("on"):
            dots = both()
    for mine, theirs in zip(fmas, reference, strict=True):  # float32 products (different builds: not bit for bit)
        assert_close(mine, theirs, torch.float32)
    assert (dots[0] - reference[0]).abs().max() > 1e-4  # q and p rounded to bfloat16: well past float32 rounding
    assert_close(dots[0], reference[0], torch.bfloat16)


# --- the LM head with a float32 output ----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inp", "outp"), [(1, 576, 49152 // 16 + 5), (7, 4096 + 13, 301), (16, 64, 33),
                                                   (37, 2048, 128)])  # (a mixture's router, in tiles of rows)
def test_linear_f32_out(isa, dtype, rows, inp, outp):
    x, w = strided(rows, inp, dtype), torch.randn(outp, inp).to(dtype)
    out = kernels.linear_f32_out(x, w)
    assert out.dtype == torch.float32 and out.shape == (rows, outp)
    expected = x.double() @ w.double().T  # the exact result of the (rounded) inputs
    torch.testing.assert_close(out.double(), expected, atol=1e-4 * inp ** 0.5, rtol=1e-5)
    if dtype == torch.bfloat16:  # a bf16 GEMM rounds its output; this one must be far closer
        rounded = (x @ w.T).double()
        assert (out.double() - expected).abs().max() < (rounded - expected).abs().max() / 10


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("outp", [128, 1200])  # a weight that stays in cache (rows in tiles), one read once
def test_linear_f32_out_gives_a_row_the_same_bits_in_any_batch(isa, dtype, outp):
    """Rows run four at a time or alone, in tiles or not: each one's logits are the same bits as alone (a seeded
    request's draw, and which experts a token takes, must not depend on its batch)."""
    x, w = torch.randn(23, 1000 + 3).to(dtype), torch.randn(outp, 1000 + 3).to(dtype)
    batch = kernels.linear_f32_out(x, w)
    for r in (0, 5, 17, 22):
        assert torch.equal(kernels.linear_f32_out(x[r:r + 1], w)[0], batch[r])
        assert torch.equal(kernels.linear_f32_out(x[r:r + 3], w)[0], batch[r])
