"""What one forward step needs besides the token ids: positions and where each token's K/V goes.

Every sequence in a step contributes its new tokens (a whole prompt, a chunk of one, or one decode
token) back to back; its K/V for all its tokens so far live in the paged cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class ForwardBatch:
    positions: torch.Tensor  # [T] int64: each new token's position in its sequence
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int32
    context_lens: torch.Tensor  # [S] int32: tokens in the cache after this step
    q_starts: torch.Tensor  # [S + 1] int64: offsets of each sequence's new tokens
    logit_indices: torch.Tensor  # [S] int64: the token of each sequence whose logits are wanted (its last)
    prompt_rows: torch.Tensor  # [S] int64: how many of each sequence's new tokens (its first) are prompt tokens
    # [S] int64, or None for all: how many of each sequence's new tokens (its last) need their final hidden state
    # (ScheduledRequest.hidden_rows); the native layer stack leaves the others' rows of its output as they were
    hidden_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @cached_property
    def row_runs(self) -> list[RowRun]:
        """The step's rows in runs of one role, prompt tokens or generated ones, as the native stack finds them
        (decoder.cpp, find_runs)."""
        runs: list[RowRun] = []

        def add(begin: int, end: int, prompt: bool) -> None:
            if begin == end:
                return
            if runs and runs[-1].prompt == prompt:
                runs[-1] = RowRun(runs[-1].begin, end, prompt)
            else:
                runs.append(RowRun(begin, end, prompt))
        starts = self.q_starts.tolist()
        for begin, end, prompt in zip(starts, starts[1:], self.prompt_rows.tolist()):
            add(begin, begin + prompt, True)
            add(begin + prompt, end, False)
        return runs


@dataclass(frozen=True)
class RowRun:
    """Rows [begin, end) of a step, all prompt tokens or none (kernels.packed_linear's `prompt`)."""
    begin: int
    end: int
    prompt: bool


def make_batch(blocks: Sequence[Sequence[int]], computed: Sequence[int], new: Sequence[int],
               block_size: int, prompt_rows: Sequence[int] | None = None) -> ForwardBatch:
    """Batch of sequences s with `computed[s]` tokens already cached and `new[s]` tokens to run.

    blocks[s] lists the cache blocks of sequence s, in order, covering computed + new tokens; prompt_rows[s]
    how many of the new ones are prompt tokens (default: all of several, none of one: a decode).
    """
    positions, slots = [], []
    for table, done, count in zip(blocks, computed, new, strict=True):
        for pos in range(done, done + count):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in blocks)
    tables = torch.full((len(blocks), width), -1, dtype=torch.int32)
    for s, table in enumerate(blocks):
        tables[s, : len(table)] = torch.tensor(table, dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(list(new)).cumsum(0).tolist()], dtype=torch.int64)
    return ForwardBatch(
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables,
        context_lens=torch.tensor([d + n for d, n in zip(computed, new, strict=True)], dtype=torch.int32),
        q_starts=starts,
        logit_indices=starts[1:] - 1,
        prompt_rows=torch.tensor([n if n > 1 else 0 for n in new] if prompt_rows is None else list(prompt_rows),
                                 dtype=torch.int64),
    )
