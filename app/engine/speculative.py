"""Speculative decoding by n-gram lookup (prompt lookup decoding): draft tokens without a draft model.

Where a sequence's last few tokens appeared before in its prompt or output, the tokens that followed them then are
a guess at what comes next (a quoted passage, code being edited, a list repeated with changes). The guess goes
into the sequence's next step after its real token; one forward pass computes them all, and the sampler takes the
guesses it would have sampled itself (app/engine/model_runner.py). A decode step reads every weight for one token,
so a few more rows cost less than a step each: on an AVX2 Zen 3 (emulated int8 dot products) about a quarter of a
one-stream step of the default model (docs/PERFORMANCE.md), so drafts pay only where most of them are kept.

What comes out is what the sequence would have sampled without drafts: a draft is a certain guess (all its
probability on one token), for which speculative sampling's rule (take draft d with probability p(d), else draw
from p without d) is the same as drawing from p and comparing. Greedy rows get the argmax, sampled rows their
usual draw, one a position, from the request's own generator where it is seeded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class SpeculativeConfig:
    num_tokens: int = 3  # drafts a step, at most
    lookup_min: int = 2  # shortest suffix looked up
    lookup_max: int = 4  # longest; the longest that matches wins
    max_batch: int = 4  # steps with more running sequences draft nothing (they are compute-bound)
    max_context: int = 16384  # tokens a lookup reads, from the end (bounds its cost on long sequences)
    max_backoff: int = 16  # steps without drafts after misses in a row, at most (see Scheduler._drafts)

    def propose(self, tokens: list[int], limit: int) -> tuple[int, ...]:
        """Up to min(num_tokens, limit) tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` (lookup_min to lookup_max long) that occurred before; () where none did."""
        count = min(self.num_tokens, limit)
        if count <= 0 or len(tokens) <= self.lookup_min:
            return ()
        history = np.asarray(tokens[-self.max_context:], dtype=np.int64)
        size = history.shape[0]
        # starts of earlier occurrences of the last token, with at least one token after them
        candidates = np.flatnonzero(history[:-1] == history[-1])
        if candidates.size == 0:
            return ()
        for n in range(min(self.lookup_max, size - 1), self.lookup_min - 1, -1):
            # windows of n tokens ending at each candidate: the suffix of n tokens occurred there
            ends = candidates[candidates >= n - 1]
            if ends.size == 0:
                continue
            windows = sliding_window_view(history[:-1], n)[ends - (n - 1)]
            hits = ends[(windows == history[-n:]).all(axis=1)]
            if hits.size:
                start = int(hits[-1]) + 1
                return tuple(history[start:start + count].tolist())
        return ()
