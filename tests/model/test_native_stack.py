"""The layer stack in one native call (app.kernels.DecoderStack) against the same model's Python layers.

Both run the same kernels in the same order, so they must agree to float32 rounding: prompts of several
sequences in one step (chunked, on shuffled cache blocks), then decode steps; on the default model in
float32 and bfloat16, int16 and int8 activations, steps longer than the stack's slab of rows, with
bfloat16 weights (packed dense), on a Qwen2-style file whose Q/K/V have biases, and on a Qwen3-style one with
per-head Q/K norms.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from app.model.batch import make_batch
from app.model.loader import load_model
from app.model.source import ModelSource, resolve_source
from app.spec.schema import ModelSpec
from tests.gguf_files import new_gguf, write_gguf
from tests.kernels.isas import running, variants
from tests.model.test_parity import Session


def _compare(model, prompts: list[list[int]], steps: int, tol: float) -> None:
    native, python = Session(model, len(prompts)), Session(model, len(prompts))
    chunks = [[p[:len(p) // 2] for p in prompts], [p[len(p) // 2:] for p in prompts]]
    for chunk in chunks:
        model.native_stack = True
        a = native.step(chunk)
        model.native_stack = False
        b = python.step(chunk)
        assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())
    assert model._stack is not None and model._stack[1] is not None  # the native stack did run
    for _ in range(steps):
        tokens = [[t] for t in b.argmax(-1).tolist()]
        model.native_stack = True
        a = native.step(tokens)
        model.native_stack = False
        b = python.step(tokens)
        assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("dtype,activations", [("float32", "int16"), ("bfloat16", "int16"), ("float32", "int8")])
def test_default_model_native_stack_matches_python_layers(dtype, activations):
    loaded = load_model(resolve_source(ModelSpec()), dtype, tokenizer=False, activations=activations)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (37, 5, 70)]
    _compare(loaded.model, prompts, steps=4, tol=1e-5 if dtype == "float32" else 1e-2)


def test_steps_longer_than_a_slab_match_python_layers():
    # the native stack runs o/norm/MLP on slabs of at most 256 rows: 290 rows a step here, the second
    # slab partial (34 rows); the Python layers take each step whole
    loaded = load_model(resolve_source(ModelSpec()), "float32", tokenizer=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (240, 180, 160)]
    _compare(loaded.model, prompts, steps=2, tol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_mixing_prompts_and_decodes_match_python_layers(dtype):
    # decode tokens and prompt chunks in turn within one step: runs of rows by role (ForwardBatch.row_runs),
    # each its own linears where the kernels run prompt rows their own way (kernels.widens_prompts); then a
    # prompt's last token alone (as after a prefix-cache hit) and a recompute's prompt and generated tokens
    loaded = load_model(resolve_source(ModelSpec()), dtype, tokenizer=False)
    model = loaded.model
    g = torch.Generator().manual_seed(4)
    first = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (9, 1, 12, 3)]
    native, python = Session(model, 4), Session(model, 4)
    tol = 1e-5 if dtype == "float32" else 1e-2
    steps = [(first, None), ([[7], [5, 6, 7, 8, 9, 10], [11], [12, 13]], None), ([[3], [4], [5, 6], [7]], [1, 0, 1, 0]),
             ([[3, 4, 5], [6], [7, 8], [9]], [2, 0, 0, 1])]
    for step, prompt_rows in steps:
        model.native_stack = True
        a = native.step(step, prompt_rows)
        model.native_stack = False
        b = python.step(step, prompt_rows)
        assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    batch = make_batch(native.blocks, [0] * 4, [1, 6, 1, 2], 16)
    assert [(r.begin, r.end, r.prompt) for r in batch.row_runs] == [(0, 1, False), (1, 7, True), (7, 8, False),
                                                                     (8, 10, True)]
    batch = make_batch(native.blocks, [0] * 4, [3, 1, 2, 1], 16, [2, 0, 0, 1])
    assert [(r.begin, r.end, r.prompt) for r in batch.row_runs] == [(0, 2, True), (2, 6, False), (6, 7, True)]


def test_bfloat16_weights_native_stack_matches_python_layers():
    # every weight expanded to bfloat16 at load: packed dense (BF16), vdpbf16ps where the CPU has it
    loaded = load_model(resolve_source(ModelSpec()), "bfloat16", tokenizer=False, quantized="dequantize")
    assert {w.type_name for w in (loaded.model.layers[0].attention.qkv.weight, loaded.model.lm_head)} == {"BF16"}
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (21, 40)]
    _compare(loaded.model, prompts, steps=4, tol=1e-2)


def test_float_activations_keep_the_python_layers():
    loaded = load_model(resolve_source(ModelSpec()), "float32", tokenizer=False, activations="float")
    Session(loaded.model, 1).step([[1, 2, 3]])
    assert loaded.model._stack is not None and loaded.model._stack[1] is None


def test_qkv_biases_native_stack_matches_python_layers(tmp_path):
    import gguf

    hidden, heads, kv_heads, inter, vocab = 256, 4, 2, 512, 512
    d = hidden // heads
    path = tmp_path / "tiny-qwen2.gguf"
    w = new_gguf(path, "qwen2", layers=2, hidden=hidden, inter=inter, heads=heads, kv_heads=kv_heads, vocab=vocab)
    rng = np.random.default_rng(0)

    def add(name, rows, cols, qtype=gguf.GGMLQuantizationType.Q8_0):
        values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", vocab, hidden)
    add("output.weight", vocab, hidden)
    w.add_tensor("output_norm.weight", (1 + rng.standard_normal(hidden) * 0.05).astype(np.float32))
    for i in range(2):
        for name, rows, cols in [("attn_q", heads * d, hidden), ("attn_k", kv_heads * d, hidden),
                                 ("attn_v", kv_heads * d, hidden), ("attn_output", hidden, heads * d),
                                 ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden), ("ffn_down", hidden, inter)]:
            add(f"blk.{i}.{name}.weight", rows, cols,
                gguf.GGMLQuantizationType.Q4_0 if name == "ffn_down" else gguf.GGMLQuantizationType.Q8_0)
        for name, rows in [("attn_q", heads * d), ("attn_k", kv_heads * d), ("attn_v", kv_heads * d)]:
            w.add_tensor(f"blk.{i}.{name}.bias", (rng.standard_normal(rows) * 0.5).astype(np.float32))
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", (1 + rng.standard_normal(hidden) * 0.05).astype(np.float32))
    write_gguf(w)
    loaded = load_model(ModelSource(path, "gguf", "tiny"), "float32", tokenizer=False)
    assert loaded.config.qkv_bias
    _compare(loaded.model, [[5, 17, 300, 2, 511, 64, 9], [3, 3, 3, 3]], steps=3, tol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_parts_of_mixed_types_native_stack_matches_python_layers(tmp_path, dtype):
    # Q and K Q4_K, V Q6_K; gate Q4_0, up Q6_K: QKV and gate/up run as two parts each, which the stack
    # writes into column ranges of one output (native) and the Python layers through column views
    from app.model.quant import PackedParts
    from tests.model.test_gguf_types import write_tiny_llama

    path = tmp_path / "tiny-parts.gguf"
    write_tiny_llama(path, [("Q4_K", "Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q6_K", "Q4_K")] * 2, embedding="Q8_0", head="Q6_K")
    loaded = load_model(ModelSource(path, "gguf", "tiny"), dtype, tokenizer=False)
    layer = loaded.model.layers[0]
    assert isinstance(layer.attention.qkv.weight, PackedParts) and layer.attention.qkv.weight.type_name == "Q4_K+Q6_K"
    assert isinstance(layer.mlp.gate_up.weight, PackedParts) and layer.mlp.gate_up.weight.type_name == "Q4_0+Q6_K"
    _compare(loaded.model, [[5, 17, 300, 2, 511, 64, 9], [3, 3, 3, 3]], steps=3, tol=1e-5 if dtype == "float32" else 1e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3s_per_head_norms_run_on_the_native_stack(tmp_path, dtype):
    """Qwen3's RMSNorm over each head of Q and K (before RoPE) in the native stack: the same logits as the Python
    layers, on Q8_0 weights (a Qwen3 file of float32 weights would take the Python layers: not packed), with heads
    of 96 (Qwen3's heads are not hidden / heads wide: Q and K norms then span other offsets than the rows')."""
    from tests.gguf_files import write_random_gguf

    path = tmp_path / "tiny-qwen3.gguf"
    write_random_gguf(path, "qwen3", seed=4, layers=2, hidden=256, inter=512, heads=4, kv_heads=2, vocab=512,
                      weight_type="Q8_0", head_dim=96, rms_eps=1e-6, rope_base=1000000.0)
    loaded = load_model(ModelSource(path, "gguf", "tiny"), dtype, tokenizer=False)
    assert loaded.config.qk_norm and loaded.config.head_dim == 96
    assert loaded.model.layers[0].attention.q_norm.numel() == 96
    _compare(loaded.model, [[5, 17, 300, 2, 511, 64, 9], [3, 3, 3, 3], list(range(100, 140))], steps=3,
             tol=1e-5 if dtype == "float32" else 1e-2)


@pytest.mark.parametrize("dtype,kind", [("float32", "Q4_K"), ("bfloat16", "Q8_0")])
def test_a_mixture_of_experts_runs_on_the_native_stack(tmp_path, dtype, kind):
    """Qwen3-MoE: the router, the top k of 8 experts, their kept-quantized projections and the weighted sum in the
    native stack give the Python layers' logits, in steps of several sequences' prompts (each expert gets rows of
    several tokens, some experts none) and of one token each. Within 1e-4 in float32, not the dense layers' 1e-5:
    each token's experts are summed in another order (the Python layers add them expert by expert over the step's
    rows, or in the top k's order for one row) and the softmax's exponentials are not torch's."""
    from tests.model.test_moe import write_qwen3_moe

    path = tmp_path / "tiny-moe.gguf"
    write_qwen3_moe(path, kind)
    loaded = load_model(ModelSource(path, "gguf", "tiny"), dtype, tokenizer=False)
    assert loaded.config.num_experts == 8
    tol = 1e-4 if dtype == "float32" else 1e-2
    _compare(loaded.model, [[5, 17, 300, 2, 511, 64, 9], [3, 3, 3, 3], list(range(100, 140))], steps=3, tol=tol)
    # one sequence: its decode steps are one row (the Python layers' path without grouping)
    _compare(loaded.model, [list(range(7, 20))], steps=3, tol=tol)


@pytest.mark.parametrize("variant", variants(tiles=True))
@pytest.mark.parametrize("dtype,kind", [("float32", "Q4_K"), ("bfloat16", "Q8_0")])
def test_a_tokens_experts_give_its_rows_alone_and_beside_a_copy(tmp_path, dtype, kind, variant):
    """Three sequences' decode rows give many of their experts one row, and those run together
    (DecoderStack::one_row_experts, the kernels' packed_linears); each sequence beside a copy of itself gives every
    expert two rows or more, run one expert at a time. Either way each token's hidden rows agree (the same tiles
    per row: within float32 rounding, not asked bit for bit across the two paths), on every kernel variant; an expert
    fed another token's row would be off by far more. (Hidden rows, not logits: this file's float32 head is torch's
    GEMM, whose sums differ between batches.)"""
    from tests.model.test_moe import write_qwen3_moe

    path = tmp_path / "tiny-moe.gguf"
    write_qwen3_moe(path, kind)
    model = load_model(ModelSource(path, "gguf", "tiny"), dtype, tokenizer=False).model
    prompts = [list(range(7, 20)), [5, 17, 300, 2, 511, 64, 9], list(range(100, 140))]
    tol = 1e-5 if dtype == "float32" else 1e-2

    def agree(a, b):
        scale = max(1.0, a.abs().max().item())
        assert (a - b[:3]).abs().max().item() <= tol * scale and (a - b[3:]).abs().max().item() <= tol * scale

    with running(variant):
        alone, pair = Session(model, 3), Session(model, 6)
        a, b = alone.rows(prompts), pair.rows(prompts + prompts)
        assert model._stack is not None and model._stack[1] is not None
        for _ in range(3):
            agree(a, b)
            tokens = [[t] for t in model.logits(a).argmax(-1).tolist()]
            a, b = alone.rows(tokens), pair.rows(tokens + tokens)
        agree(a, b)


def test_a_mixture_of_experts_over_more_rows_than_its_chunk(tmp_path):
    """The stack runs experts on chunks of 1,024 rows: a step of 1,200 prompt rows (the second chunk partial, and
    more than the 256-row slabs of the layers' first half) gives the Python layers' logits."""
    from tests.model.test_moe import write_qwen3_moe

    path = tmp_path / "tiny-moe.gguf"
    write_qwen3_moe(path, "Q8_0")
    model = load_model(ModelSource(path, "gguf", "tiny"), "float32", tokenizer=False).model
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (500, 400, 300)]
    native, python = Session(model, 3, capacity=512), Session(model, 3, capacity=512)
    model.native_stack = True
    a = native.step(prompts)
    model.native_stack = False
    b = python.step(prompts)
    assert model._stack is not None and model._stack[1] is not None
    assert (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item())


def test_a_layers_experts_are_checked_as_they_are_added(tmp_path):
    """DecoderStack.add_layer names what is wrong with a layer's experts (the caller's bug, not a model's)."""
    import dataclasses

    from app import kernels
    from app.model.llama import _parts
    from app.model.quant import ACTIVATIONS
    from tests.gguf_files import write_random_gguf

    path = tmp_path / "moe.gguf"
    write_random_gguf(path, "qwen3moe", seed=3, layers=1, hidden=256, inter=512, heads=4, kv_heads=2, vocab=512,
                      experts=4, experts_used=2, expert_inter=256, expert_type="Q8_0", weight_type="Q8_0")
    model = load_model(ModelSource(path, "gguf", "m"), "float32", tokenizer=False).model
    layer, cache = model.layers[0], model.new_kv_cache(4, 16)[0]
    a, m = layer.attention, layer.mlp
    good = kernels.Experts(m.router, [_parts(e.gate_up) for e in m.experts], [_parts(e.down) for e in m.experts], 2,
                           True)

    def add(experts, mlp=([], [])):
        stack = kernels.DecoderStack(torch.float32, ACTIVATIONS["int16"], 256, 4, 2, 64, 256, 1e-6, 0.125,
                                     model.cos_sin, model.norm)
        stack.add_layer(_parts(a.qkv), _parts(a.o), *mlp, layer.input_norm, layer.post_norm, None, *cache, a.q_norm,
                        a.k_norm, experts)

    add(good)
    wrong = [(dataclasses.replace(good, top_k=5), "top_k: must be in [1, 4]"),
             (dataclasses.replace(good, gate_up=good.gate_up[:3]), "given 3 gate/up and 4 down"),
             (dataclasses.replace(good, router=m.router.bfloat16()), "router: must be [experts, 256] in the"),
             (dataclasses.replace(good, router=m.router[:, :128].contiguous()), "router: must be [experts, 256]")]
    for experts, message in wrong:
        with pytest.raises(ValueError, match=re.escape(message)):
            add(experts)
    with pytest.raises(ValueError, match="either a dense MLP"):
        add(good, (_parts(m.experts[0].gate_up), _parts(m.experts[0].down)))
    with pytest.raises(ValueError, match="either a dense MLP"):
        add(None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_last_layer_on_the_kept_rows_only_gives_those_rows_bits(dtype):
    """ForwardBatch.hidden_rows: the native stack's last layer runs its attention, o and MLP only on each sequence's
    last hidden_rows rows (the sampled ones, a scored prompt's every row, none of a chunk that samples nothing);
    those rows come out with the same bits as in a step that computes every row, and the keys and values of every
    row are still written: the next steps, which read them, match too."""
    import dataclasses

    loaded = load_model(resolve_source(ModelSpec()), dtype, tokenizer=False)
    model = loaded.model
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (30, 7, 300, 12)]
    every, kept = Session(model, 4, capacity=320), Session(model, 4, capacity=320)
    # (new tokens of each sequence, hidden rows of each): chunks that sample nothing (the last layer on no row at
    # all); a prompt's last row; none of a chunk; a prompt scored whole; then decodes, one with three drafts' rows
    steps = [([p[:10] for p in prompts], [0, 0, 0, 0]), ([p[10:20] for p in prompts], [1, 0, 10, 0]),
             ([p[20:] for p in prompts], [1, 7, 1, 280]),
             ([[5], [6], [7], [8, 9, 10, 11]], [1, 1, 1, 4]), ([[5, 6], [7], [8], [9]], [0, 1, 1, 1])]
    for new, hidden in steps:
        if not all(new):
            continue
        outputs = []
        for session, rows in ((every, None), (kept, torch.tensor(hidden, dtype=torch.int64))):
            done = [len(t) for t in session.tokens]
            batch = make_batch(session.blocks, done, [len(n) for n in new], 16, [len(n) if len(n) > 1 else 0
                                                                                   for n in new])
            batch = dataclasses.replace(batch, hidden_rows=rows)
            for t, n in zip(session.tokens, new, strict=True):
                t.extend(n)
            outputs.append((batch, model.forward(torch.tensor([x for n in new for x in n]), batch, session.cache)))
        (batch, a), (_, b) = outputs
        starts = batch.q_starts.tolist()
        wanted = [r for s, k in enumerate(hidden) for r in range(starts[s + 1] - k, starts[s + 1])]
        assert torch.equal(a[wanted], b[wanted])
        others = sorted(set(range(batch.num_tokens)) - set(wanted))
        assert not others or not torch.equal(a[others], b[others])  # (the last layer did skip them)
    assert model._stack is not None and model._stack[1] is not None  # the native stack did run
