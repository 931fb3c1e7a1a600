"""`python -m app.benchmark.attention --against`: two cache dtypes timed alternately, and what is reported of them."""

from __future__ import annotations

import pytest
import torch

from app.benchmark import attention
from app.benchmark.attention import paired_stats


def test_the_paired_ratio_is_the_median_of_each_rounds_ratio_not_the_ratio_of_medians():
    pair = paired_stats([1.0, 2.0, 4.0, 8.0, 3.0], [2.0, 2.0, 2.0, 2.0, 3.0])
    assert (pair.first, pair.second) == (3.0, 2.0)  # the medians: their ratio would be 0.67
    assert pair.ratio == 1.0 and (pair.low, pair.high) == (0.25, 2.0)  # rounds: 2, 1, 0.5, 0.25, 1
    with pytest.raises(ValueError):
        paired_stats([1.0, 2.0], [1.0])  # a round without its partner is a bug, not a shorter list


def test_pair_attention_alternates_the_two_caches_and_flips_the_order_each_round(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "_stepper", lambda *args: (lambda kv=args[5]: calls.append(kv)))
    attention.pair_attention(torch.float32, [40], [1], 4, (torch.float32, torch.float16), calls=2)
    f32, f16 = torch.float32, torch.float16
    assert calls == [f32, f32, f16, f16, f16, f16, f32, f32] * 2  # 4 rounds of 2 calls of each, the order flipped


def test_pair_attention_runs_the_kernel_over_both_caches():
    pair = attention.pair_attention(torch.float32, [40, 17], [1, 1], 4, (torch.float32, torch.float16),
                                    heads=(4, 2, 64), block=8, layers=2, calls=1)
    assert pair.first > 0 and pair.second > 0
    assert pair.low <= pair.ratio <= pair.high
