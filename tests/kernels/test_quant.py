"""Kept-quantized GGUF weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K to Q6_K and IQ4_XS as stored; the
superblock types converted into exact blocks of 32 where a cut needs it), and bfloat16
weights packed alike: the native kernels against gguf's own numpy
dequantization followed by a torch matmul, on every ISA this CPU supports, on odd shapes.

The blocks come from gguf.quants.quantize (the gguf package's reference implementation), so the
layout our kernels read is the one llama.cpp's files hold; gguf cannot quantize K-quants or the IQ4 types, so
theirs are random bytes with small float16 scales, dequantized by gguf all the same.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from app import kernels
from app.model.quant import BF16, PackedParts, PackedWeight, QuantizedParts, QuantizedTensor, fuse_rows, linear, pack
from app.model.weights import _unpermute
from tests.kernels.isas import running, variants

ISAS = kernels.supported_isas()
GT = gguf.GGMLQuantizationType
TYPES = [GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1, GT.Q8_0, GT.IQ4_NL]  # blocks of 32
SUPERBLOCK = [GT.Q2_K, GT.Q3_K, GT.Q4_K, GT.Q5_K, GT.Q6_K, GT.IQ4_XS]  # kept as stored, in superblocks of 256
# types gguf cannot quantize (random bytes): where a block's float16 d (and dmin) sit, and their range; weights
# then within about +-0.3, as real ones
K_SCALES = {GT.Q2_K: ([80, 82], 5e-3), GT.Q3_K: ([108], 2e-3), GT.Q4_K: ([0, 2], 3e-4), GT.Q5_K: ([0, 2], 1.5e-4),
            GT.Q6_K: ([208], 3e-5), GT.IQ4_NL: ([0], 2.5e-3), GT.IQ4_XS: ([0], 7e-5)}


@pytest.fixture(params=variants(tiles=True))
def isa(request):
    with running(request.param):
        yield request.param


def file_blocks(rows: int, features: int, qtype, seed: int = 0) -> np.ndarray:
    """Random weights as a GGUF file's blocks of `qtype`, [rows, bytes]."""
    rng = np.random.default_rng(seed)
    if qtype in K_SCALES:
        per, size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, size=(rows, features // per, size), dtype=np.uint8)
        offsets, top = K_SCALES[qtype]
        for offset in offsets:
            scales = rng.uniform(top / 3, top, size=blocks.shape[:2]).astype(np.float16)
            blocks[..., offset:offset + 2] = scales[..., None].view(np.uint8)
        return blocks.reshape(rows, -1)
    return gguf.quants.quantize(rng.standard_normal((rows, features)).astype(np.float32) * 0.1, qtype)


def quantized(rows: int, features: int, qtype, seed: int = 0) -> tuple[QuantizedTensor, torch.Tensor]:
    """Random weights as kept blocks, and gguf's own dequantization of the file's blocks (float32)."""
    blocks = file_blocks(rows, features, qtype, seed)
    reference = torch.from_numpy(np.array(gguf.quants.dequantize(blocks, qtype), dtype=np.float32))
    return QuantizedTensor(torch.from_numpy(blocks.copy()), qtype.value, features), reference


@pytest.mark.parametrize("qtype", TYPES + SUPERBLOCK, ids=lambda t: t.name)
def test_dequantize_is_exact(isa, qtype):
    q, reference = quantized(37, 96 if qtype in TYPES else 512, qtype)
    assert torch.equal(q.dequantize(), reference)
    assert torch.equal(q.dequantize(torch.bfloat16), reference.to(torch.bfloat16))
    assert torch.equal(q.in_blocks_of_32().dequantize(), reference)


def quantize_activations(x: torch.Tensor, activations: str) -> torch.Tensor:
    """x as the kernels see it: per block of 32, h = round(x * 127 / max|x|) and, for int16, a second plane
    l = round((x * 127 / max|x| - h) * 256) in [-127, 127]; x = max|x| / 127 * (h + l / 256)."""
    if activations == "float":
        return x.float()
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    peak = blocks.abs().amax(-1, keepdim=True)
    y = blocks * (torch.full_like(peak, 127.0) / peak)  # (torch computes 127.0 / peak as 127 * (1 / peak))
    h = torch.round(y)
    value = h if activations == "int8" else h + torch.clamp(torch.round((y - h) * 256), -127, 127) / 256
    return torch.nan_to_num(peak / 127 * value).reshape(x.shape)  # an all-zero block is 0


ACTIVATIONS = ["int16", "int8", "float"]


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 32), (1, 130, 576), (2, 9, 64), (3, 7, 96), (4, 31, 128), (100, 33, 64),
                                           (5, 33, 64), (17, 67, 160), (64, 260, 288), (65, 64, 96), (131, 17, 32)])
def test_linear_matches_dequantize_then_matmul(isa, qtype, activations, m, n, k):
    """Against x (quantized as the kernel does, in torch) @ gguf's dequantized weights in float64: the integer
    dot products are exact, so only float32 rounding separates them."""
    q, w = quantized(n, k, qtype, seed=m + n + k)
    packed = q.pack(activations)
    x = torch.randn(m, k)
    x[0, :32] = 0  # an all-zero block
    expected = (quantize_activations(x, activations).double() @ w.double().T).float()
    torch.testing.assert_close(packed.linear(x), expected, atol=2e-5, rtol=2e-5)
    # bfloat16 activations: widened exactly, accumulated in float32, one rounding of the output
    xb = x.to(torch.bfloat16)
    expected_b = (quantize_activations(xb, activations).double() @ w.double().T).float()
    torch.testing.assert_close(packed.linear(xb, torch.float32), expected_b, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(packed.linear(xb).float(), expected_b.to(torch.bfloat16).float(), atol=2e-2,
                               rtol=1.6e-2)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 32), (1, 130, 576), (3, 7, 96), (4, 31, 128), (17, 67, 160), (131, 65, 64)])
def test_bfloat16_weights_packed_match_torch(isa, m, n, k):
    """Dense bfloat16 weights in the packed layout (BF16): float32 x is never rounded, bfloat16 x meets them
    in vdpbf16ps (exact products) or FMAs; both against the float64 product of the same values."""
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.1).to(torch.bfloat16)
    packed = pack(w, "int16")
    assert isinstance(packed, PackedWeight) and packed.qtype == BF16 and packed.type_name == "BF16"
    x = torch.randn(m, k)
    torch.testing.assert_close(packed.linear(x), (x.double() @ w.double().T).float(), atol=2e-5, rtol=2e-5)
    xb = x.to(torch.bfloat16)
    expected = (xb.double() @ w.double().T).float()
    torch.testing.assert_close(packed.linear(xb, torch.float32), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(packed.linear(xb).float(), expected.to(torch.bfloat16).float(), atol=2e-2, rtol=1.6e-2)
    ids = torch.tensor([n - 1, 0, n // 2])
    assert torch.equal(packed.embedding(ids, torch.bfloat16), w[ids])  # the rows come back bit for bit
    assert torch.equal(packed.dequantize(torch.float32), w.float())


def test_float32_weights_stay_torch_tensors():
    w = torch.randn(8, 64)
    assert pack(w, "int16") is w
    odd = torch.randn(8, 40).to(torch.bfloat16)  # not a multiple of 32 features: torch's GEMM
    assert pack(odd, "int16") is odd


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("qtype", SUPERBLOCK, ids=lambda t: t.name)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 256), (1, 130, 512), (3, 7, 256), (4, 33, 768), (17, 67, 256),
                                           (65, 64, 256), (131, 17, 256), (2, 40, 2304)])
def test_superblock_types_match_dequantize_then_matmul(isa, qtype, activations, m, n, k):
    """K-quants and IQ4_XS in their superblocks: the same check as above (Q2_K's, Q3_K's and Q6_K's scale per 16
    weights takes its own tile, which sums each half of a block apart, or with int16 activations and more than
    12 rows in a chunk, the word tile; 17 rows and more form a superblock's scales once for all their row
    tiles; 65 and 131 rows leave chunks of 1 and 3 rows to the halves tile)."""
    q, w = quantized(n, k, qtype, seed=m + n + k)
    packed = q.pack(activations)
    x = torch.randn(m, k)
    x[0, :32] = 0  # an all-zero block
    x[-1, 48:64] = 0  # and an all-zero half block
    expected = (quantize_activations(x, activations).double() @ w.double().T).float()
    torch.testing.assert_close(packed.linear(x), expected, atol=2e-5, rtol=2e-5)
    xb = x.to(torch.bfloat16)
    expected_b = (quantize_activations(xb, activations).double() @ w.double().T).float()
    torch.testing.assert_close(packed.linear(xb, torch.float32), expected_b, atol=2e-5, rtol=2e-5)
    ids = torch.tensor([n - 1, 0])
    assert torch.equal(packed.embedding(ids, torch.float32), w[ids])


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_mixed_types_fuse_as_parts(isa, activations):
    """A fused weight whose parts differ in type (Q4_K_M: V as Q6_K, Q and K as Q4_K) keeps each run of one
    type as one part in its own blocks; the parts' linear fills each its own columns of one output."""
    parts = [quantized(n, 768, qtype, seed=n) for n, qtype in  # three superblocks a K-quant row
             ((64, GT.Q4_K), (16, GT.Q4_K), (19, GT.Q6_K), (16, GT.Q8_0), (5, GT.Q4_0), (33, GT.Q4_1), (7, GT.Q5_K),
              (9, GT.Q3_K), (6, GT.IQ4_NL), (13, GT.IQ4_XS))]
    fused = fuse_rows([q for q, _ in parts])
    w = torch.cat([w for _, w in parts])
    assert isinstance(fused, QuantizedParts) and fused.type_name == "Q4_K+Q6_K+Q8_0+Q4_0+Q4_1+Q5_K+Q3_K+IQ4_NL+IQ4_XS"
    assert fused.shape == (188, 768) and torch.equal(fused.dequantize(), w)
    packed = fused.pack(activations)
    assert isinstance(packed, PackedParts) and [p.rows for p in packed.parts] == [80, 19, 16, 5, 33, 7, 9, 6, 13]
    assert torch.equal(packed.dequantize(), w)
    for m in (1, 3, 70):
        x = torch.randn(m, 768)
        x[0, 16:32] = 0  # an all-zero half block
        expected = (quantize_activations(x, activations).double() @ w.double().T).float()
        torch.testing.assert_close(packed.linear(x), expected, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(linear(x.view(1, m, 768), packed), expected.view(1, m, -1), atol=2e-5, rtol=2e-5)
        xb = x.to(torch.bfloat16)
        expected_b = (quantize_activations(xb, activations).double() @ w.double().T).float()
        torch.testing.assert_close(packed.linear(xb, torch.float32), expected_b, atol=2e-5, rtol=2e-5)
    same = fuse_rows([parts[0][0], parts[1][0]])  # one type: one weight
    assert isinstance(same, QuantizedTensor) and same.type_name == "Q4_K"


def test_converted_types_keep_their_size_and_refuse_bad_input():
    for qtype, bits in ((GT.Q2_K, 2.625), (GT.Q3_K, 3.4375), (GT.Q4_K, 4.5), (GT.Q5_K, 5.5), (GT.Q6_K, 6.5625),
                        (GT.IQ4_XS, 4.25), (GT.Q5_0, 5.5), (GT.Q5_1, 6)):
        q, _ = quantized(3, 512, qtype)
        assert q.nbytes * 8 == bits * 3 * 512, qtype.name
    for qtype, bits, packed in ((GT.Q2_K, 8, 3.125), (GT.Q3_K, 10, 3.625), (GT.Q4_K, 6, 4.625), (GT.Q5_K, 10, 5.625),
                                (GT.Q6_K, 10, 6.625), (GT.IQ4_XS, 5, 4.375)):
        q, _ = quantized(3, 512, qtype)
        assert q.in_blocks_of_32().nbytes * 8 == bits * 3 * 512  # Q4_HM32, Q8_H32, Q4_M32, Q8_M32, Q8_H32, IQ4_F32
        # packed: per 16 rows and 256 weights, 8 blocks of nibbles (Q5_K, Q6_K: and 1 or 2 planes of high bits;
        # Q2_K: of crumbs; Q3_K: crumbs and a plane),
        # a byte code each for scale and min (Q3_K, Q6_K: the scales of both halves) and a head of fp16 d and
        # -dmin (Q3_K, Q6_K: f32 d; IQ4_XS: f32 d and one code a block; Q2_K: fp16 d and -dmin, a scale and a
        # min code each per half block)
        assert kernels.ops._native.packed_bytes(qtype.value, 64, 512) * 8 == packed * 64 * 512
    for qtype, packed in ((GT.Q5_0, 5.5), (GT.Q5_1, 6)):  # as the file: nibbles, a plane of fifth bits, fp16 d (and m)
        assert kernels.ops._native.packed_bytes(qtype.value, 64, 512) * 8 == packed * 64 * 512
    raw = torch.from_numpy(file_blocks(2, 256, GT.Q4_K).copy())
    with pytest.raises(ValueError, match="is not converted"):
        kernels.convert_quant(raw, GT.IQ2_XS.value, 256)
    with pytest.raises(ValueError, match="rows must be 144 bytes for 256 features"):
        kernels.convert_quant(raw[:, :100].contiguous(), GT.Q4_K.value, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        kernels.convert_quant(raw, GT.Q4_K.value, 160)


@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_quantized_activations_stay_close_to_float32(activations):
    """What the quantization costs against exact float32 arithmetic (int16: about 2^-16 of each block's
    largest value; int8: about 2^-8)."""
    q, w = quantized(256, 576, gguf.GGMLQuantizationType.Q4_1)
    x = torch.randn(8, 576)
    exact, mine = x.double() @ w.double().T, q.pack(activations).linear(x).double()
    error = ((mine - exact).abs().max() / exact.abs().max()).item()
    assert error < (5e-5 if activations == "int16" else 1e-2), error


def test_every_isa_gives_the_same_sums():
    q, _ = quantized(70, 128, gguf.GGMLQuantizationType.Q4_1)
    x = torch.randn(9, 128)
    for activations in ACTIVATIONS:
        packed = q.pack(activations)
        results = []
        for isa in ISAS:
            with kernels.use_isa(isa):
                results.append(packed.linear(x))
        for other in results[1:]:
            torch.testing.assert_close(other, results[0], atol=1e-5, rtol=1e-5)  # float32 rounding only


def test_linear_takes_strided_rows_and_leading_dimensions(isa):
    q, w = quantized(40, 64, gguf.GGMLQuantizationType.Q4_1)
    packed = q.pack("float")
    x = torch.randn(6, 64 + 11)[:, :64]
    assert not x.is_contiguous()
    torch.testing.assert_close(packed.linear(x), x @ w.T, atol=2e-5, rtol=2e-5)
    x3 = torch.randn(2, 3, 64)
    torch.testing.assert_close(packed.linear(x3), x3 @ w.T, atol=2e-5, rtol=2e-5)
    bias = torch.randn(40)
    torch.testing.assert_close(linear(x, packed, bias), x @ w.T + bias, atol=2e-5, rtol=2e-5)
    many = torch.randn(100, 64)  # "float" expands the weight for torch's GEMM past 64 rows
    torch.testing.assert_close(packed.linear(many), many @ w.T, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("qtype", [GT.Q4_1, GT.Q5_0, GT.Q2_K, GT.Q3_K, GT.Q5_K, GT.Q6_K], ids=lambda t: t.name)
def test_a_row_gives_the_same_result_in_any_batch(isa, qtype):
    """Each activation row is quantized and summed on its own, in the same order whatever the tile (37 rows
    take the expanded bytes or words of the 5- and 6-bit and 2- and 3-bit types, one row their own tiles): a
    sequence's logits do not depend on what else is in the step."""
    k = 512 if qtype.value >= GT.Q2_K.value else 160
    q, _ = quantized(96, k, qtype)
    x = torch.randn(37, k)
    for activations in ("int16", "int8"):
        packed = q.pack(activations)
        alone = torch.cat([packed.linear(x[i:i + 1]) for i in range(37)])
        assert torch.equal(packed.linear(x), alone)
        assert torch.equal(packed.linear(x[5:9]), alone[5:9])
    if qtype != GT.Q4_1:
        return
    dense = pack((torch.randn(96, 160) * 0.1).to(torch.bfloat16), "int16")  # BF16 weights, bfloat16 rows
    xb = x.to(torch.bfloat16)
    alone = torch.cat([dense.linear(xb[i:i + 1], torch.float32) for i in range(37)])
    assert torch.equal(dense.linear(xb, torch.float32), alone)


CUTS = {"Q4_M32": GT.Q4_K, "Q8_M32": GT.Q5_K, "IQ4_F32": GT.IQ4_XS}  # our blocks of 32, cut from these


@pytest.mark.skipif("avx2" not in ISAS, reason="only the avx2 kernels have narrow int16 row tiles")
@pytest.mark.parametrize("qtype", [GT.Q4_0, GT.Q4_1, GT.Q4_K, GT.Q8_0, GT.Q5_0, GT.Q5_1, GT.Q5_K, GT.IQ4_NL, GT.IQ4_XS,
                                   *CUTS], ids=lambda t: getattr(t, "name", t))
def test_narrow_and_wide_row_tiles_give_the_same_bits(qtype):
    """The avx2 kernels' int16 row tiles take one row or several (kernels.wide_int_tiles: whichever suits the
    CPU's multiplier), and wide, a row chunk of more than 4 rows runs as 16-bit words expanded once (packed.h,
    expands_words): the same exact integer sums and float32 steps per row, so the same bits, at every row count
    (1 to 9: whole tiles and each remainder; 37; 66 and 68, a second row chunk of 2 and of 4), for float32 and
    bfloat16 rows, and close to the float64 reference."""
    if qtype in CUTS:  # a tensor-parallel cut off a superblock: our type of the same values
        q, w = quantized(80, 1536, CUTS[qtype])
        q, w, k = q.columns(range(288, 576)), w[:, 288:576], 288
        assert q.type_name == qtype
    else:
        k = 512 if qtype in (GT.Q4_K, GT.Q5_K, GT.IQ4_XS) else 160
        q, w = quantized(80, k, qtype)
    with kernels.use_isa("avx2"):
        packed = q.pack("int16")
        for x in (torch.randn(68, k), torch.randn(68, k).to(torch.bfloat16)):
            for rows in [*range(1, 10), 37, 66, 68]:
                with kernels.use_int_tiles("narrow"):
                    narrow = packed.linear(x[:rows], torch.float32)
                with kernels.use_int_tiles("wide"):
                    wide = packed.linear(x[:rows], torch.float32)
                assert torch.equal(narrow, wide), (x.dtype, rows)
                reference = (x[:rows].double() @ w.double().T).float()
                torch.testing.assert_close(wide, reference, atol=2e-3 * reference.abs().max().item(), rtol=0)
    assert kernels.int_mul_ratio() > 0 and kernels.wide_int_tiles() == (kernels.int_mul_ratio() >= 0.75)


@pytest.mark.parametrize("qtype", [GT.Q4_1, GT.Q8_0, GT.Q5_K, GT.Q6_K, GT.Q2_K], ids=lambda t: t.name)
def test_a_row_with_nan_or_infinity_gives_no_finite_output_and_leaves_the_others(isa, qtype):
    """Quantizing x to integers must not turn a NaN or an infinity into a finite number (a broken model's hidden
    state would become made-up logits): none of that row's outputs is finite (NaN from the integer tiles; the
    float path gives what float32 arithmetic does), and the other rows are what they are alone. Bad values where a block's maximum can drop a NaN (its second vector
    finite, or the rest of the block zeros), an infinity, and a row with both; one row, and among 37. A block of
    finite values too small to scale (denormals among them) stays finite: as zeros."""
    k = 512
    q, _ = quantized(48, k, qtype)
    x = torch.randn(37, k)
    bad = {3: [(40, float("nan"))], 7: [(3, float("nan")), (20, 2.0)], 11: [(70, float("inf"))],
           12: [(100, float("-inf")), (101, float("nan"))], 20: [(129, float("nan"))]}
    x[20, 128:160] = 0.0  # row 20's fifth block: zeros and one NaN
    for row, values in bad.items():
        for col, value in values:
            x[row, col] = value
    x[30, 64:96] = torch.tensor([1e-38, -3e-37, 0.0, 1e-45] * 8)  # row 30's third block: finite, too small to scale
    zeroed = x[30:31].clone()
    zeroed[0, 64:96] = 0.0
    for activations in ("int16", "int8", "float"):
        packed = q.pack(activations)
        out = packed.linear(x)
        if activations != "float":  # (the integer tiles take it as zeros; the float path keeps its tiny products)
            assert torch.equal(out[30], packed.linear(zeroed)[0])
        for row in range(37):
            if row in bad:
                assert not torch.isfinite(out[row]).any(), (activations, row)
            elif activations == "float":  # (float32 FMAs: compared within float32 rounding)
                torch.testing.assert_close(out[row], packed.linear(x[row:row + 1])[0])
            else:  # (integer sums: exact in any tile)
                assert torch.equal(out[row], packed.linear(x[row:row + 1])[0])
        assert not torch.isfinite(packed.linear(x[7:8])).any() and not torch.isfinite(packed.linear(x[20:21])).any()


@pytest.mark.parametrize("qtype", TYPES + SUPERBLOCK, ids=lambda t: t.name)
def test_prompt_rows_take_the_exact_products_where_the_kernels_widen(isa, qtype):
    """int16 rows marked as prompt tokens: where the kernels widen the type's weights (AVX2, but not the types that
    expand to words where multiplies are cheap), float32 FMAs on the reference's products, ten times closer to
    x @ w than int16's quantized x (~2e-5 of the largest output); elsewhere the integer tiles (or words), as any
    row. Either way a row gets the same bits alone or among 37 rows, and an unmarked row still gets int16's."""
    k = 512 if qtype in SUPERBLOCK else 160
    q, w = quantized(67, k, qtype, seed=3)
    packed = q.pack("int16")
    x = torch.randn(37, k)
    x[0, :32] = 0  # an all-zero block
    exact = kernels.widens_prompts(packed.qtype)
    for rows in (x, x.to(torch.bfloat16)):
        reference = rows.double() @ w.double().T
        expected = reference if exact else quantize_activations(rows, "int16").double() @ w.double().T
        got = packed.linear(rows, torch.float32, prompt=True)
        error = ((got.double() - expected).abs().max() / reference.abs().max()).item()
        assert error < (2e-6 if exact else 2e-5), error
        alone = torch.cat([packed.linear(rows[i:i + 1], torch.float32, prompt=True) for i in range(37)])
        assert torch.equal(got, alone)
    decode = packed.linear(x)
    assert torch.equal(decode, torch.cat([packed.linear(x[i:i + 1]) for i in range(37)]))
    assert torch.equal(packed.linear(x, prompt=True), decode) != exact


def test_q6_k_words_do_not_overflow_at_their_bound(isa):
    """The word tile's largest sums: every Q6_K weight q = -32 under the scale code -128 (w = 4,096) against a
    constant x (every combined integer 32,512): 2.13e9 a half, within int32; a block's 4.26e9 is not, and
    its halves add in float32."""
    block = np.zeros(210, np.uint8)  # ql and qh 0 (q = -32), 16 int8 scales, fp16 d
    block[192:208] = np.array([-128] * 16, np.int8).view(np.uint8)
    block[208:210] = np.array([1.0], np.float16).view(np.uint8)
    rows, k = 16, 512
    q = QuantizedTensor(torch.from_numpy(np.tile(block, (rows, k // 256))), GT.Q6_K.value, k)
    x = torch.full((20, k), 0.5)
    expected = torch.full((20, rows), 4096.0 * 0.5 * k)
    for m in (1, 8, 20):  # the halves tile, and (more than 12 rows) the words
        torch.testing.assert_close(q.pack("int16").linear(x[:m]), expected[:m], rtol=1e-5, atol=0)


@pytest.mark.parametrize("qtype", [GT.Q4_0, GT.Q4_1, GT.Q5_1], ids=lambda t: t.name)
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_small_weights_do_not_overflow_the_pair_sums(isa, qtype, activations):
    """Where the CPU has no VNNI, 4-bit weights' products add up in int16 through a block (I32x16::pairs): their
    largest, every u = 15 (Q5_1: 31) against x's bytes at +-127 in both planes, must come out exact."""
    head = {GT.Q4_0: [1.0], GT.Q4_1: [1.0, 0.0], GT.Q5_1: [1.0, 0.0]}[qtype]
    block = np.concatenate([np.array(head, np.float16).view(np.uint8),
                            np.full(4 if qtype == GT.Q5_1 else 0, 0xff, np.uint8), np.full(16, 0xff, np.uint8)])
    rows, k = 16, 96
    blocks = np.tile(block, (rows, k // 32))
    weight = torch.from_numpy(np.array(gguf.quants.dequantize(blocks, qtype), dtype=np.float32))
    q = QuantizedTensor(torch.from_numpy(blocks.copy()), qtype.value, k)
    # each block's first x at its peak (h = 127), the rest at 126 + 127/256 of it (h = 126, l = 127), either sign
    x = torch.full((8, k), 126.49609375 / 127)
    x[:, ::32] = 1.0
    x[1::2] *= -1
    expected = (x.double() @ weight.double().T).float()
    for m in (1, 3, 8):
        torch.testing.assert_close(q.pack(activations).linear(x[:m]), expected[:m], rtol=1e-2 if activations == "int8" else 1e-4,
                                   atol=0)


@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_any_byte_weights_come_out_exact_at_their_extremes(isa, activations):
    """Where the CPU has no VNNI, Q8_0's bytes meet x as u - 128 (I32x16::centered_dot4, a vpsignb moving x's sign):
    q = -128 (|u - 128| = 128, the one that does not fit a signed byte) and 127, in runs and alternating, against x's
    bytes at +-127, must come out exact, in both the batch-1 and the row tiles."""
    rows, k = 16, 96
    pattern = np.array([[-128] * 32, [127] * 32, [-128, 127] * 16, [127, -128] * 16], np.int8)
    qs = pattern[np.arange(rows * (k // 32)) % 4].reshape(rows, k // 32, 32)
    head = np.broadcast_to(np.array([1.0], np.float16).view(np.uint8), (rows, k // 32, 2))
    blocks = np.concatenate([head, qs.view(np.uint8)], axis=2).reshape(rows, -1)
    weight = torch.from_numpy(np.array(gguf.quants.dequantize(blocks, GT.Q8_0), dtype=np.float32))
    q = QuantizedTensor(torch.from_numpy(blocks.copy()), GT.Q8_0.value, k)
    # x's bytes at +-127 (int16: h = 127 at each block's first x, else h = 126 and l = 127, as in the pair-sum test),
    # in values each quantizes exactly, so that the sums, which cancel, are compared exactly
    x = torch.full((8, k), 1.0 if activations == "int8" else 126.49609375 / 127)
    x[:, ::32] = 1.0
    x[1::2] *= -1
    x[2::4, 1::2] *= -1
    expected = (x.double() @ weight.double().T).float()
    for m in (1, 3, 8):
        torch.testing.assert_close(q.pack(activations).linear(x[:m]), expected[:m], rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize(("qtype", "cut_type"), [(GT.Q2_K, "Q4_HM32"), (GT.Q3_K, "Q8_H32"), (GT.Q4_K, "Q4_M32"),
                                                (GT.Q5_K, "Q8_M32"), (GT.Q6_K, "Q8_H32"), (GT.IQ4_XS, "IQ4_F32")],
                         ids=["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_k_quants_cut_within_their_superblocks_come_back_in_blocks_of_32(isa, qtype, cut_type):
    """A tensor-parallel shard of a K-quant weight's input features that does not fall on 256 (here 576 / 2)
    is the same values in blocks of 32; one that does stays as it was."""
    q, w = quantized(20, 1536, qtype)
    aligned = q.columns(range(768, 1536))
    assert aligned.type_name == qtype.name and torch.equal(aligned.dequantize(), w[:, 768:])
    cut = q.columns(range(288, 576))
    assert cut.type_name == cut_type and torch.equal(cut.dequantize(), w[:, 288:576])
    assert q.columns(range(16, 256)) is None
    for activations in ACTIVATIONS:
        packed = cut.pack(activations)
        for m in (3, 17):  # one row tile, and several
            x = torch.randn(m, 288)
            expected = (quantize_activations(x, activations).double() @ w[:, 288:576].double().T).float()
            torch.testing.assert_close(packed.linear(x), expected, atol=2e-5, rtol=2e-5)
        assert torch.equal(packed.embedding(torch.tensor([19, 0]), torch.float32), w[[19, 0], 288:576])
    assert torch.equal(q.rows(torch.tensor([19, 2])).dequantize(), w[[19, 2]])


def test_rows_columns_and_fusion_keep_the_blocks():
    q, w = quantized(48, 128, gguf.GGMLQuantizationType.Q4_1)
    assert torch.equal(q.rows(range(8, 20)).dequantize(), w[8:20])
    index = torch.tensor([5, 0, 47, 5])
    assert torch.equal(q.rows(index).dequantize(), w[index])
    assert torch.equal(q.columns(range(32, 96)).dequantize(), w[:, 32:96])
    assert q.columns(range(16, 96)) is None  # not on a block boundary
    other, w2 = quantized(8, 128, gguf.GGMLQuantizationType.Q4_1, seed=1)
    fused = fuse_rows([q, other])
    assert isinstance(fused, QuantizedTensor) and torch.equal(fused.dequantize(), torch.cat([w, w2]))
    q8, w8 = quantized(8, 128, gguf.GGMLQuantizationType.Q8_0, seed=2)
    mixed = fuse_rows([q, q8, torch.ones(3, 128)])  # types differ: expanded to the float parts' dtype
    assert isinstance(mixed, torch.Tensor) and torch.equal(mixed, torch.cat([w, w8, torch.ones(3, 128)]))


def test_unpermute_moves_whole_rows_like_the_float_path():
    q, w = quantized(4 * 16, 64, gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(_unpermute(q, heads=4).dequantize(), _unpermute(w, heads=4))


@pytest.mark.parametrize("qtype", TYPES + SUPERBLOCK, ids=lambda t: t.name)
def test_packed_rows_dequantize_exactly(isa, qtype):
    features = 64 if qtype in TYPES else 768
    q, w = quantized(100, features, qtype)
    packed = q.pack("int16")
    assert isinstance(packed, PackedWeight) and packed.shape == (100, features)
    ids = torch.tensor([3, 99, 3, 0, 16, 17])
    assert torch.equal(packed.embedding(ids, torch.float32), w[ids])
    assert torch.equal(packed.embedding(ids, torch.bfloat16), w[ids].to(torch.bfloat16))
    assert torch.equal(packed.dequantize(), w)


def test_bad_arguments_are_errors_not_crashes():
    q, _ = quantized(4, 64, gguf.GGMLQuantizationType.Q4_0)
    packed = q.pack("int16")
    with pytest.raises(ValueError, match="not a packed weight type"):
        kernels.pack_quant(q.data, 9, 64)  # Q8_1: no kernel
    with pytest.raises(ValueError, match="multiple of 256"):
        kernels.pack_quant(q.data, 12, 64)  # Q4_K
    with pytest.raises(ValueError, match="rows must be 36 bytes"):
        kernels.pack_quant(q.data[:, :20].contiguous(), 2, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.packed_linear(torch.randn(1, 48), packed.data, 2, 48, 4, 2)
    with pytest.raises(ValueError, match=r"x must be \[S, K\]"):
        kernels.packed_linear(torch.randn(1, 32), packed.data, 2, 64, 4, 2)
    with pytest.raises(ValueError, match="packed takes"):
        kernels.packed_linear(torch.randn(1, 64), packed.data[:-1], 2, 64, 4, 2)
    with pytest.raises(ValueError, match="act: must be"):
        kernels.packed_linear(torch.randn(1, 64), packed.data, 2, 64, 4, 7)
    with pytest.raises(TypeError, match="uint8"):
        kernels.packed_linear(torch.randn(1, 64), packed.data.float(), 2, 64, 4, 2)
    with pytest.raises(ValueError, match="is not a row of 4"):
        kernels.packed_rows(packed.data, torch.tensor([4]), 2, 64, 4)
    with pytest.raises(ValueError, match="does not hold rows of 48 weights"):
        QuantizedTensor(q.data, 2, 48)
    with pytest.raises(ValueError, match="activations must be one of"):
        q.pack("int4")
