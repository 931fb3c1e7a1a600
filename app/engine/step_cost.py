"""How long a step will take, so the scheduler can size prompt chunks to a wall-time budget.

A step's time is modelled as `overhead + per_token * prompt_tokens + per_decode * decodes + per_pair *
attention_pairs`, where an attention pair is one (query, visible key) product: a chunk of n new tokens
after p cached ones makes n*p + n(n+1)/2 of them, a decode at context c makes c. The token terms are the
GEMMs (linear in tokens), the pair term the attention (quadratic in a prompt's length: why a token count
alone cannot bound a step at 8k context). A decode token (a sequence's only row in the step) has its own
term: the linears run its row apart from prompt rows where the kernels widen the weights for prompts
(kernels.widens_prompts: 2.5x a prompt token's time on a 2-core Zen 1 at 32 sequences), and a decode
step reads the weights for few rows elsewhere. The coefficients are fitted at start from a few timed forward passes
(`calibrate`), then a running correction factor follows measured steps, so a slower (busier) machine
gets smaller chunks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

MIN_CHUNK = 16  # a prefill chunk smaller than this is not worth a step of its own: wait for the next
# The calibration's passes of n tokens aim at this long each (n at most 128, at least 16), so that it takes
# about the same time for any model: a 1.2B-parameter Q4_K_M took 5 s to calibrate at 128, the engine's
# start. Passes of 0.25 s, best of 3, took 1.95 s of the default spec's 6.7 s start on a 2-core Zen 1.
CALIBRATION_PASS = 0.1  # seconds
CALIBRATION_REPEAT = 2  # passes a shape, the fastest kept
DECODE_PASS = 8  # decode tokens (sequences of one row) in the calibration's decode pass
# A cached fit is kept when its first prompt pass and its one-token decode pass take within this factor of what
# they took then: a start runs 5 passes (the warm-up, two of 16 prompt tokens, two of one decode token; the
# decode runs other kernels than a prompt) of the 9 to 11, and the running correction starts at how much slower
# or faster they ran. Outside it (a much busier, throttled or other machine than when the fit was made), the fit
# is made anew. 1.3 refitted one warm start in two on a 2-vCPU KVM guest whose passes of 16 tokens varied 1.4x
# from start to start (a refit there is no better: its coefficients varied as much); 1.5 still refits where a
# prompt pass or a decode pass takes 1.6x what it took.
CACHED_AGREEMENT = 1.5


def attention_pairs(num_computed: int, count: int) -> int:
    """Query-key products of `count` new tokens after `num_computed` cached ones (causal)."""
    return count * num_computed + count * (count + 1) // 2


@dataclass
class StepShape:
    """What is in a step so far."""

    tokens: int = 0
    pairs: int = 0
    decodes: int = 0  # of the tokens, those that are their sequence's only one (the rest: prompt tokens)

    def add(self, num_computed: int, count: int) -> None:
        self.tokens += count
        self.pairs += attention_pairs(num_computed, count)
        self.decodes += count == 1


class StepCost:
    def __init__(self, overhead: float, per_token: float, per_pair: float, budget: float, pass_tokens: int = 0,
                 per_decode: float | None = None, checks: tuple[int, float, float] = (0, 0.0, 0.0)):
        self.overhead, self.per_token, self.per_pair = overhead, per_token, per_pair
        self.per_decode = per_token if per_decode is None else per_decode
        self.budget = budget  # seconds per step
        self.correction = 1.0  # measured / modelled, smoothed
        self.pass_tokens = pass_tokens  # the calibration's pass size (0: not calibrated)
        # its first timed passes (prompt tokens, their seconds, one decode token's), how a cached fit is checked
        self.checks = checks
        self.from_cache = False

    def _raw(self, shape: StepShape) -> float:
        return self.overhead + self.per_token * (shape.tokens - shape.decodes) + self.per_decode * shape.decodes + \
            self.per_pair * shape.pairs

    def predict(self, shape: StepShape) -> float:
        return self._raw(shape) * self.correction

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Fold a measured step into the correction factor (in log space, clamped against outliers)."""
        modelled = self._raw(shape)
        if modelled <= 0 or seconds <= 0:
            return
        ratio = min(max(seconds / modelled, 0.2), 5.0)
        self.correction = math.exp(0.8 * math.log(self.correction) + 0.2 * math.log(ratio))

    def max_chunk(self, shape: StepShape, num_computed: int, wanted: int, limit: float | None = None) -> int:
        """The most of `wanted` new tokens (after `num_computed` cached) that keep the step's predicted time
        within `limit` seconds (default: the budget)."""
        left = (self.budget if limit is None else limit) / self.correction - self._raw(shape)
        if left <= 0:
            return 0
        # per_pair/2 n^2 + (per_token + per_pair * (num_computed + 1/2)) n <= left
        a, b = self.per_pair / 2, self.per_token + self.per_pair * (num_computed + 0.5)
        n = left / b if a <= 0 else (-b + math.sqrt(b * b + 4 * a * left)) / (2 * a)
        return max(0, min(wanted, int(n)))

    @classmethod
    def calibrate(cls, run: Callable[..., None], budget: float, max_tokens: int, max_seqs: int = DECODE_PASS,
                  cached: StepCost | None = None) -> StepCost:
        """Fit the four coefficients from timed forward passes: `run(count, num_computed)` (a prompt of
        `count` tokens), `run(count, 0, decodes=True)` (`count` sequences of one token each, sequence i
        after i cached tokens).

        `cached`: an earlier fit of the same model on the same kernels, CPU and shapes (app.engine.core keeps
        them on disk). It is returned when the first timed passes take about what they took then (`agrees`), its
        running correction starting at their ratio, so that a start after the first runs 5 of the 9 to 11 passes;
        otherwise the fit goes on as without it.

        Passes: 1 decode token and DECODE_PASS of them (overhead, decodes; no more than `max_seqs`, the
        staging buffers' sequences: with 1, a decode costs as a prompt token), `n` tokens at context 0 (GEMMs),
        `n` tokens after at least 4n cached (attention, up to 512); `max_tokens` bounds n plus that context,
        the most the KV cache and the staging buffers take. n is at most 128, and fewer where a pass of 128 would
        take more than about CALIBRATION_PASS (judged from a pass of 16 after the warm-up), down to 16 (then that
        pass is the prompt pass too): the calibration's time stays about the same for larger models.
        """
        most = max(2, min(128, max_tokens // 5))
        first = min(16, most)
        run(first, 0)  # warm-up: first calls allocate and pick GEMM kernels
        estimate = _timed(run, first, 0, CALIBRATION_REPEAT)
        decodes = partial(run, decodes=True)
        t1 = _timed(decodes, 1, 0, CALIBRATION_REPEAT)
        if cached is not None and cached.agrees(first, estimate, t1):
            cached.budget, cached.from_cache = budget, True
            cached.correction = math.sqrt(estimate / cached.checks[1] * t1 / cached.checks[2])
            return cached
        per_token = estimate / first  # an upper bound: the pass's overhead is in it
        n = max(first, min(most, int(CALIBRATION_PASS / per_token) if per_token > 0 else most))
        if n < first * 3 // 2:  # the estimate's passes are the prompt pass: 0.2 s of a 2-core Zen 1's 5 s start
            n = first
        # the fastest of two each: the HTTP frontend may still be booting on the same CPUs, and one pass
        # disturbed by it skewed the fit up to 2x (per-token and per-pair terms alike)
        # the attention pass sees as much cached context as n = 128 did (512), so that its extra time stays
        # well above the noise with fewer new tokens
        context = max(4 * n, min(512, max_tokens - n))
        d = max(1, min(DECODE_PASS, most, max_seqs))
        td, tn, tp = (_timed(pass_, count, cached, CALIBRATION_REPEAT) if count else 0.0
                      for pass_, count, cached in ((decodes, d if d > 1 else 0, 0), (run, n if n > first else 0, 0),
                                                   (run, n, context)))
        tn = tn or estimate
        p1, pn, pp = attention_pairs(0, 1), attention_pairs(0, n), attention_pairs(context, n)
        per_pair = max((tp - tn) / (pp - pn), 1e-11)  # clamped: a noisy machine may time them out of order
        if d == 1:  # the 1-token pass gives the overhead, the prompt pass the rest
            per_token = per_decode = max((tn - t1 - per_pair * (pn - p1)) / (n - 1), 1e-7)
        else:
            pd = sum(attention_pairs(i, 1) for i in range(d))
            per_decode = max((td - t1 - per_pair * (pd - p1)) / (d - 1), 1e-7)
        overhead = max(t1 - per_decode - per_pair * p1, 1e-4)
        per_token = max((tn - overhead - per_pair * pn) / n, 1e-7)
        return cls(overhead, per_token, per_pair, budget, pass_tokens=n, per_decode=per_decode,
                   checks=(first, estimate, t1))

    def agrees(self, count: int, prompt: float, decode: float) -> bool:
        """Whether a pass of `count` prompt tokens at context 0 and one of a decode token took what they took when
        this fit was made, within CACHED_AGREEMENT (the passes themselves, not the fit's prediction of them: the
        fit is linear in tokens, the kernels' speed at 16 rows is not quite)."""
        then_count, then_prompt, then_decode = self.checks
        return then_count == count and all(then > 0 and 1 / CACHED_AGREEMENT <= now / then <= CACHED_AGREEMENT
                                           for now, then in ((prompt, then_prompt), (decode, then_decode)))

    def to_json(self) -> dict:
        """The fit (not the budget or the running correction), for the calibration cache."""
        return {"overhead": self.overhead, "per_token": self.per_token, "per_decode": self.per_decode,
                "per_pair": self.per_pair, "pass_tokens": self.pass_tokens, "checks": list(self.checks)}

    @classmethod
    def from_json(cls, fields: dict, budget: float) -> StepCost:
        """A fit `to_json` wrote; ValueError/TypeError/KeyError where it is not one."""
        values = {name: float(fields[name]) for name in ("overhead", "per_token", "per_decode", "per_pair")}
        if not all(0 < v < 10 and math.isfinite(v) for v in values.values()):
            raise ValueError(f"not a step cost fit: {fields}")
        count, prompt, decode = fields["checks"]
        return cls(values["overhead"], values["per_token"], values["per_pair"], budget,
                   pass_tokens=int(fields["pass_tokens"]), per_decode=values["per_decode"],
                   checks=(int(count), float(prompt), float(decode)))

    def describe(self) -> str:
        cached = f", cached, at {self.correction:.2f}x its checks' time" if self.from_cache else ""
        fitted = f" (passes of {self.pass_tokens} tokens{cached})" if self.pass_tokens else ""
        return (f"step time ~ {self.overhead * 1e3:.1f} ms + {self.per_token * 1e6:.0f} us/prompt token + "
                f"{self.per_decode * 1e6:.0f} us/decode token + {self.per_pair * 1e9:.2f} ns/attention pair{fitted}; "
                f"budget {self.budget * 1e3:.0f} ms")


def _timed(run: Callable[[int, int], None], count: int, num_computed: int, repeat: int = 1) -> float:
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        run(count, num_computed)
        best = min(best, time.perf_counter() - start)
    return best
