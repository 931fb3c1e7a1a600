"""Which attention heads and MLP features each tensor-parallel rank takes (torch-free: the planner uses it).

Attention is split by KV-head groups: a rank takes whole KV heads with their query heads. Any tp up
to the number of query heads works, not only divisors: KV heads are dealt out as evenly as whole
heads allow (SmolLM2, 9 query / 3 KV heads, at tp=2: 6+3 query and 2+1 KV heads); with more ranks
than KV heads, each KV head is replicated on a run of ranks that split its query heads (vLLM's
rule; 8 / 2 at tp=4: every rank has 2 query heads and 1 KV head). MLP features are split evenly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSplit:
    q_heads: range  # global indices of this rank's query heads
    kv_heads: range  # ...and of the KV heads they attend to


def split_features(n: int, parts: int) -> list[range]:
    """An MLP's (or each expert's) `n` features over `parts` TP ranks: evenly, in whole blocks of 32 where each rank
    gets one at least (a cut off them would expand a quantized down projection, whose input features it cuts, to
    the compute dtype: Llama 3 8B's 14,336 at tp=3 split as 4,779 / 4,779 / 4,778 did; now 4,800 / 4,768 / 4,768)."""
    return split_evenly(n, parts, 32)


def split_evenly(n: int, parts: int, unit: int = 1) -> list[range]:
    """`n` items in `parts` contiguous runs whose sizes differ by at most one (larger runs first); by whole `unit`s
    where `n` holds at least one a part."""
    if unit > 1 and n % unit == 0 and n // unit >= parts:
        return [range(r.start * unit, r.stop * unit) for r in split_evenly(n // unit, parts)]
    base, extra = divmod(n, parts)
    runs, start = [], 0
    for part in range(parts):
        size = base + (part < extra)
        runs.append(range(start, start + size))
        start += size
    return runs


def split_heads(num_heads: int, num_kv_heads: int, tp: int) -> list[HeadSplit]:
    """Each rank's query and KV heads; raises ValueError when tp exceeds the query heads."""
    if not 1 <= tp <= num_heads:
        raise ValueError(f"tp = {tp} must be between 1 and the model's {num_heads} attention heads")
    group = num_heads // num_kv_heads  # query heads per KV head
    if tp <= num_kv_heads:
        splits = []
        for kv in split_evenly(num_kv_heads, tp):
            splits.append(HeadSplit(range(kv.start * group, kv.stop * group), kv))
        return splits
    splits = []
    for kv, ranks in enumerate(split_evenly(tp, num_kv_heads)):  # a run of ranks per KV head
        for q in split_evenly(group, len(ranks)):
            splits.append(HeadSplit(range(kv * group + q.start, kv * group + q.stop), range(kv, kv + 1)))
    return splits
