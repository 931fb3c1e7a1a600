"""The layers every Llama-family model is made of, on the native kernels (GEMMs stay with torch).

Each layer holds this rank's shard: its attention heads and MLP features, or each expert's features in a
mixture of experts (see app/parallel/shard.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app import kernels
from app.model.batch import ForwardBatch, RowRun
from app.model.config import ModelConfig
from app.model.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from app.model.quant import linear

KVCache = tuple[torch.Tensor, torch.Tensor]  # key [blocks, kv_heads, head_dim, block_size], value [.., block_size, head_dim]
# (bfloat16 ones pair neighbours within a block: kernels.kv_cache_from_blocks says how)


class Attention:
    """Fused QKV projection, optional per-head Q/K norm, RoPE, paged cache write and attention."""

    def __init__(self, cfg: ModelConfig, heads: int, kv_heads: int, qkv: QKVParallelLinear, o: RowParallelLinear,
                 q_norm: torch.Tensor | None, k_norm: torch.Tensor | None):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, cfg.head_dim  # this rank's heads
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim ** -0.5
        self.qkv, self.o, self.q_norm, self.k_norm = qkv, o, q_norm, k_norm

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache, cos_sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H] (summed over the TP group by the output projection)
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv.split(self.qkv(x, batch.row_runs))  # [T, Hq D], [T, Hk D], [T, Hk D]
        if self.q_norm is not None:  # Qwen3: RMSNorm over each head's features, before RoPE
            q = kernels.rms_norm(q.reshape(t * self.heads, d), self.q_norm, self.eps).view(t, -1)
            k = kernels.rms_norm(k.reshape(t * self.kv_heads, d), self.k_norm, self.eps).view(t, -1)
        kernels.rotary_embedding(batch.positions, q, k, cos_sin, d)
        kernels.write_kv_cache(k.view(t, self.kv_heads, d), v.view(t, self.kv_heads, d), *cache, batch.slot_mapping)
        out = kernels.paged_attention(q.view(t, self.heads, d), *cache, batch.block_tables, batch.context_lens,
                                      batch.q_starts, self.scale)
        return self.o(out.view(t, self.heads * d), batch.row_runs)


class MLP:
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one projection."""

    def __init__(self, gate_up: MergedColumnParallelLinear, down: RowParallelLinear):
        self.gate_up, self.down = gate_up, down

    def __call__(self, x: torch.Tensor, runs: Sequence[RowRun] = ()) -> torch.Tensor:
        # x: [T, H] -> [T, H] (summed over the TP group by the down projection); runs: x's rows by role
        return self.down(kernels.silu_and_mul(self.gate_up(x, runs)), runs)

    def linears(self) -> list:
        return [self.gate_up, self.down]

    def tensors(self) -> list[torch.Tensor]:
        return self.gate_up.tensors() + self.down.tensors()


class MoE:
    """A mixture of experts in place of the MLP (Mixtral, Qwen3-MoE): the router scores every expert for each
    token, the token goes through the `top_k` best (a softmax over all experts, then the top k, rescaled to
    sum to 1 where `renormalize`), and their outputs, weighed by those scores, are summed in float32. Each
    expert is a SwiGLU MLP over this rank's share of its features (its down projection not reduced, its output
    float32), so the experts' partial sums meet in one float32 all-reduce. The router [experts, H] is a plain
    tensor in the compute dtype, its logits float32. A model whose linears are all packed runs this in the native
    layer stack instead (DecoderStack::mixture, native/src/decoder.cpp)."""

    def __init__(self, router: torch.Tensor, experts: Sequence[MLP], top_k: int, renormalize: bool, group):
        self.router, self.experts, self.top_k, self.renormalize = router, list(experts), top_k, renormalize
        self.group = group

    def __call__(self, x: torch.Tensor, runs: Sequence[RowRun] = ()) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        scores = torch.softmax(kernels.linear_f32_out(x, self.router), dim=-1)  # float32 logits, as the native stack
        weights, chosen = scores.topk(self.top_k, dim=-1)  # [T, k] each
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        if x.shape[0] == 1:  # one stream's decode: its k experts in turn, without grouping (PERFORMANCE.md: MoE)
            out, role = torch.zeros(x.shape, dtype=torch.float32), [RowRun(0, 1, bool(runs) and runs[0].prompt)]
            for expert, weight in zip(chosen[0].tolist(), weights[0].tolist(), strict=True):
                out.add_(self._expert(expert, x, role), alpha=weight)
            return self._reduce(out).to(x.dtype)
        # the (token, choice) pairs grouped by expert, each expert's tokens in step order: one gather of their rows,
        # each expert's output into its slice of one buffer, one weighted scatter back (per expert only its call)
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        routed, prompt = x[tokens], _prompt_mask(runs, x.shape[0])
        outputs = torch.empty(routed.shape, dtype=torch.float32)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                end = start + count
                outputs[start:end] = self._expert(expert, routed[start:end], _runs_of(prompt, tokens[start:end]))
                start = end
        outputs.mul_(weights.flatten()[order, None])
        out = torch.zeros(x.shape, dtype=torch.float32).index_add_(0, tokens, outputs)
        return self._reduce(out).to(x.dtype)

    def _expert(self, index: int, x: torch.Tensor, runs: Sequence[RowRun]) -> torch.Tensor:
        """One expert's (partial) output for rows `x`, float32."""
        mlp = self.experts[index]
        hidden = kernels.silu_and_mul(mlp.gate_up(x, runs))
        return linear(hidden, mlp.down.weight, runs=runs, out_dtype=torch.float32).float()

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(out) if self.group.size > 1 else out

    def linears(self) -> list:
        return [linear for expert in self.experts for linear in expert.linears()]

    def tensors(self) -> list[torch.Tensor]:
        return [self.router] + [t for expert in self.experts for t in expert.tensors()]


def _prompt_mask(runs: Sequence[RowRun], rows: int) -> torch.Tensor | bool:
    """Which of a step's rows are prompt tokens: one bool for all where the step's rows have one role."""
    if len(runs) <= 1:
        return bool(runs) and runs[0].prompt
    mask = torch.zeros(rows, dtype=torch.bool)
    for run in runs:
        mask[run.begin:run.end] = run.prompt
    return mask


def _runs_of(prompt: torch.Tensor | bool, rows: torch.Tensor) -> list[RowRun]:
    """The runs of one role among some of a step's rows (`rows`, in step order), as linear() takes them."""
    if not isinstance(prompt, torch.Tensor):
        return [RowRun(0, len(rows), prompt)]
    roles = prompt[rows]
    edges = [0, *(torch.nonzero(roles[1:] != roles[:-1]).flatten() + 1).tolist(), len(rows)]
    return [RowRun(begin, end, bool(roles[begin])) for begin, end in zip(edges, edges[1:])]


class DecoderLayer:
    def __init__(self, attention: Attention, mlp: MLP, input_norm: torch.Tensor, post_norm: torch.Tensor, eps: float):
        self.attention, self.mlp = attention, mlp
        self.input_norm, self.post_norm, self.eps = input_norm, post_norm, eps

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, cache: KVCache,
                 cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H]. The residual stream is carried separately so each norm fuses its add.
        if residual is None:
            residual = x
            x = kernels.rms_norm(x, self.input_norm, self.eps)
        else:
            kernels.add_rms_norm(x, residual, self.input_norm, self.eps)
        x = self.attention(x, batch, cache, cos_sin)
        kernels.add_rms_norm(x, residual, self.post_norm, self.eps)
        return self.mlp(x, batch.row_runs), residual
