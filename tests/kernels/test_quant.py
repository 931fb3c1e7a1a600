"""Kept-quantized GGUF weights (Q4_0, Q4_1, Q8_0): the native kernels against gguf's own numpy
dequantization followed by a torch matmul, on every ISA this CPU supports, on odd shapes.

The blocks come from gguf.quants.quantize (the gguf package's reference implementation), so the
layout our kernels read is the one llama.cpp's files hold.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from app import kernels
from app.model.quant import QuantizedTensor, fuse_rows, linear
from app.model.weights import _unpermute

ISAS = kernels.supported_isas()
TYPES = [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0]


@pytest.fixture(params=ISAS)
def isa(request):
    with kernels.use_isa(request.param):
        yield request.param


def quantized(rows: int, features: int, qtype, seed: int = 0) -> tuple[QuantizedTensor, torch.Tensor]:
    """Random weights as GGUF blocks, and gguf's own dequantization of them (float32)."""
    w = np.random.default_rng(seed).standard_normal((rows, features)).astype(np.float32) * 0.1
    blocks = gguf.quants.quantize(w, qtype)
    reference = torch.from_numpy(np.array(gguf.quants.dequantize(blocks, qtype), dtype=np.float32))
    return QuantizedTensor(torch.from_numpy(blocks.copy()), qtype.value, features), reference


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_exact(isa, qtype):
    q, reference = quantized(37, 96, qtype)
    assert torch.equal(q.dequantize(), reference)
    assert torch.equal(q.dequantize(torch.bfloat16), reference.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 32), (1, 130, 576), (2, 9, 64), (3, 7, 96), (4, 31, 128), (100, 33, 64), (5, 33, 64), (17, 67, 160),
                                           (64, 260, 288)])
def test_linear_matches_dequantize_then_matmul(isa, qtype, m, n, k):
    q, w = quantized(n, k, qtype, seed=m + n + k)
    x = torch.randn(m, k)
    expected = x @ w.T
    torch.testing.assert_close(q.linear(x), expected, atol=2e-5, rtol=2e-5)
    # bfloat16 activations: widened exactly, accumulated in float32, one rounding of the output
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(q.linear(xb).float(), (xb.float() @ w.T).to(torch.bfloat16).float(), atol=2e-2,
                               rtol=1.6e-2)
    torch.testing.assert_close(q.linear(xb, torch.float32), xb.float() @ w.T, atol=2e-5, rtol=2e-5)


def test_linear_takes_strided_rows_and_leading_dimensions(isa):
    q, w = quantized(40, 64, gguf.GGMLQuantizationType.Q4_1)
    x = torch.randn(6, 64 + 11)[:, :64]
    assert not x.is_contiguous()
    torch.testing.assert_close(q.linear(x), x @ w.T, atol=2e-5, rtol=2e-5)
    x3 = torch.randn(2, 3, 64)
    torch.testing.assert_close(q.linear(x3), x3 @ w.T, atol=2e-5, rtol=2e-5)
    bias = torch.randn(40)
    torch.testing.assert_close(linear(x, q, bias), x @ w.T + bias, atol=2e-5, rtol=2e-5)


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


def test_embedding_rows(isa):
    q, w = quantized(100, 64, gguf.GGMLQuantizationType.Q8_0)
    ids = torch.tensor([3, 99, 3, 0])
    assert torch.equal(q.embedding(ids, torch.float32), w[ids])


def test_bad_arguments_are_errors_not_crashes():
    q, _ = quantized(4, 64, gguf.GGMLQuantizationType.Q4_0)
    with pytest.raises(ValueError, match="not a kept-quantized GGUF type"):
        kernels.quant_linear(torch.randn(1, 64), q.data, 12, 64)  # Q4_K
    with pytest.raises(ValueError, match="rows must be 36 bytes"):
        kernels.quant_linear(torch.randn(1, 64), q.data[:, :20].contiguous(), 2, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.quant_linear(torch.randn(1, 48), q.data, 2, 48)
    with pytest.raises(ValueError, match=r"x must be \[S, K\]"):
        kernels.quant_linear(torch.randn(1, 32), q.data, 2, 64)
    with pytest.raises(TypeError, match="uint8"):
        kernels.quant_linear(torch.randn(1, 64), q.data.float(), 2, 64)
    with pytest.raises(ValueError, match="does not hold rows of 48 weights"):
        QuantizedTensor(q.data, 2, 48)
