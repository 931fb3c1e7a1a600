"""The cos/sin table the rotary-embedding kernel reads: [max_position, rotary_dim], cos then sin."""

from __future__ import annotations

import math

import torch

from app.model.config import RopeScaling


def inverse_frequencies(rotary_dim: int, theta: float, scaling: RopeScaling,
                        factors: torch.Tensor | None = None) -> torch.Tensor:
    """[rotary_dim / 2] float64; `factors` are GGUF's rope_freqs (Llama-3 scaling, precomputed)."""
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    if factors is not None:
        return inv / factors.double()
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "llama3":
        return _llama3(inv, scaling)
    return inv


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv / s.factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / s.factor, blended)
    return torch.where(wavelen < high_wavelen, inv, out)


def cos_sin_table(max_position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    # -> [max_position, 2 * len(inv_freq)] float32: cos(p * f) then sin(p * f), computed in float64
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq.double())
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float().contiguous()
