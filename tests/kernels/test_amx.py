"""The AMX-INT8 row tiles (native/include/amx_tile.h): int16 row chunks of 16 rows and more of the types with one
scale a block (Q4_0, Q4_1, Q8_0, Q4_K, ours; the Q5 types as bytes) on tile multiplies, 16 rows x 16 weight rows x 32
products an instruction.

No CPU these tests have run on has AMX, so the tiles' algorithm (the weights as B tiles, x's planes as A tiles at a
row stride, partial tiles, both panels, the float32 steps) runs here with its multiplies emulated in software
(`kernels.use_amx_tiles("emulated")`), on every x86 kernel variant, and must give the vector tiles' bits: the same
exact integer sums and float32 operations. On an AMX CPU the kernels use the CPU's multiplies only after checking
them against the emulated ones (amx.cpp, amx_check); `amx_status` says which, and why not.
"""

from __future__ import annotations

import platform
import warnings

import gguf
import pytest
import torch

from app import _native, kernels
from tests.kernels.isas import running, variants
from tests.kernels.test_quant import CUTS, quantized

GT = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AMX is x86-64's")

# one scale a block: as packed (Q4_0, Q4_1, Q8_0, Q4_K, ours), or as bytes once their fifth bits are added (Q5_*)
AMX_TYPES = [GT.Q4_0, GT.Q4_1, GT.Q8_0, GT.Q4_K, GT.Q5_0, GT.Q5_1, GT.Q5_K, "Q4_M32", "Q8_M32"]


@pytest.fixture(params=[v for v in variants(tiles=True) if not v.startswith("portable")])
def isa(request):
    with running(request.param):
        yield request.param


def weights(qtype, rows: int = 72):
    """A packed weight of `qtype` (rows not a multiple of 16: a panel pair's second panel is partly padding) and
    its float32 values."""
    if qtype in CUTS:  # our blocks of 32, made by cutting a superblock type off 256
        q, w = quantized(rows, 1536, CUTS[qtype])
        q, w = q.columns(range(288, 576)), w[:, 288:576]
        assert q.type_name == qtype
    else:
        q, w = quantized(rows, 512 if qtype in (GT.Q4_K, GT.Q5_K) else 224, qtype)
    return q.pack("int16"), w


@pytest.mark.parametrize("qtype", AMX_TYPES, ids=lambda t: getattr(t, "name", t))
def test_emulated_amx_rows_give_the_vector_tiles_bits(isa, qtype):
    """16 rows (one full tile), 17 (and a partial tile of 1), 31 (of 15), 37, 64 (a row chunk of four tiles), 70
    (a chunk, then 6 rows the vector tiles take) and 130; float32 and bfloat16 rows, float32 and bfloat16 out;
    prompt rows too. Bit for bit the vector tiles' result, close to the float64 reference, and the AMX rows did run
    wherever a row chunk of 16 or more reaches them (not the Q5 types under avx2's wide tiles, which take 16-bit
    words before their fifth bits could be added; nor prompt rows where AVX2 widens them to float32)."""
    packed, w = weights(qtype)
    k = w.shape[1]
    words_first = isa == "avx2-wide" and qtype in (GT.Q5_0, GT.Q5_1, GT.Q5_K)
    torch.manual_seed(1)
    for x in (torch.randn(130, k), torch.randn(130, k).to(torch.bfloat16)):
        for rows in (16, 17, 31, 37, 64, 70, 130):
            for out_dtype, prompt in ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True)):
                widened = prompt and kernels.widens_prompts(packed.qtype)
                with kernels.use_amx_tiles("off"):
                    vector = packed.linear(x[:rows], out_dtype, prompt=prompt)
                before = kernels.amx_row_chunks()
                with kernels.use_amx_tiles("emulated"):
                    amx = packed.linear(x[:rows], out_dtype, prompt=prompt)
                assert (kernels.amx_row_chunks() > before) == (not widened and not words_first), (rows, prompt)
                if widened:
                    continue  # (AVX2 where multiplies are slow: these prompt rows never reach the integer tiles)
                assert torch.equal(vector, amx), (x.dtype, rows, out_dtype, prompt)
                if out_dtype == torch.float32 and not prompt:
                    reference = (x[:rows].double() @ w.double().T).float()
                    torch.testing.assert_close(amx, reference, atol=3e-3 * reference.abs().max().item(), rtol=0)


def test_emulated_amx_rows_keep_a_bad_row_to_itself(isa):
    """A NaN or an infinity in a row makes that row's outputs NaN (x's scale is NaN: act_quant.cpp) and leaves the
    others what they are without it, in a full tile and a partial one."""
    packed, _ = weights(GT.Q4_1)
    x = torch.randn(37, packed.in_features)
    clean = x.clone()
    x[3, 40], x[20, 100], x[35, 7] = float("nan"), float("inf"), float("-inf")
    with kernels.use_amx_tiles("emulated"):
        out, alone = packed.linear(x, torch.float32), packed.linear(clean, torch.float32)
    bad = [3, 20, 35]
    assert torch.isnan(out[bad]).all()
    good = [r for r in range(37) if r not in bad]
    with kernels.use_amx_tiles("off"):
        assert torch.equal(out[good], packed.linear(clean, torch.float32)[good])
    assert torch.equal(out[good], alone[good])


def test_amx_status_says_what_runs_and_why():
    """Under "auto" the CPU's tiles run only where its flags say AMX-TILE and AMX-INT8 (and the kernel grants them,
    and they pass the check); elsewhere the status names what is missing. The modes switch and switch back."""
    flags = set(open("/proc/cpuinfo").read().split())
    status = kernels.amx_status()
    if not {"avx512_bf16", "avx512_vnni"} <= flags:
        assert status == "the CPU has no AVX512-BF16 and VNNI"
    elif not {"amx_tile", "amx_int8"} <= flags:
        assert status == "the CPU has no AMX-TILE and AMX-INT8"
    else:  # an AMX CPU: the start check must not find the CPU's tiles differing from the emulation (a fault here)
        assert "differ" not in status, status
        if status not in ("in use", "usable, but the kernels in force are not avx512bf16"):
            warnings.warn(f"AMX CPU, tiles not used: {status}")  # Linux refused them (e.g. a too-small signal stack)
    with kernels.use_amx_tiles("off"):
        assert kernels.amx_status() == "off"
        with kernels.use_amx_tiles("emulated"):
            assert kernels.amx_status() == "emulated in software (tests)"
        assert kernels.amx_status() == "off"
    assert kernels.amx_status() == status
    with pytest.raises(ValueError, match="not one of auto, off, emulated"):
        with kernels.use_amx_tiles("on"):
            pass


def test_the_start_check_runs_to_its_end(isa):
    """amx_check's comparisons (one multiply on random tiles of 16 and 5 rows; the AMX rows of a small Q4_1 and Q8_0
    weight), with the emulated multiplies standing in for the CPU's, in each x86 kernel build this CPU runs (the
    avx512bf16 one is where amx.cpp runs them with the CPU's): they run to their end and find nothing to differ."""
    assert _native.amx_emulated_self_check() is None
