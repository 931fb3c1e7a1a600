"""Mixtures of experts (Qwen3-MoE, Mixtral): small random models written here, against transformers.

transformers runs its own router (softmax, top k, renormalized) and its own experts on the weights it reads
itself: a Qwen3-MoE GGUF file it dequantizes, a Mixtral directory of safetensors. The Mixtral GGUF file is
written from that directory the way llama.cpp's converter writes one (Q and K permuted for its rotary
layout, the experts stacked), so it is checked against the same reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from app.model.config import UnsupportedModel
from app.model.layers import MoE
from app.model.loader import load_model
from app.model.source import ModelSource
from tests.gguf_files import new_gguf, write_gguf, write_random_gguf
from tests.model.test_parity import Session

HIDDEN, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 4, 2, 512, 2
EXPERTS, USED, EXPERT_INTER = 8, 2, 256
PROMPTS = [[5, 17, 300, 2, 511, 64, 9, 100, 200], [1, 2, 3], list(range(40, 90))]


def write_qwen3_moe(path: Path, expert_type: str) -> None:
    """Attention of Q8_0 where the experts are kept quantized (the native layer stack runs such a model), float32
    where they are (the Python layers)."""
    write_random_gguf(path, "qwen3moe", seed=3, layers=LAYERS, hidden=HIDDEN, inter=512, heads=HEADS,
                      kv_heads=KV_HEADS, vocab=VOCAB, experts=EXPERTS, experts_used=USED, expert_inter=EXPERT_INTER,
                      expert_type=expert_type, weight_type="F32" if expert_type == "F32" else "Q8_0", rms_eps=1e-6,
                      rope_base=1000000.0)


def gguf_reference(path: Path, **config):
    from transformers import AutoModelForCausalLM, GgufConfig

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=path.name, dequantize=True), **config).eval()


@pytest.fixture(scope="module", params=["F32", "Q8_0", "Q4_K", "Q6_K"])
def qwen3_moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3moe") / f"qwen3moe-{request.param}.gguf"
    write_qwen3_moe(path, request.param)
    # transformers' GGUF reader does not read expert_feed_forward_length (it would take Qwen3-MoE's default, 768)
    return path, request.param, gguf_reference(path, moe_intermediate_size=EXPERT_INTER)


def follow(ours, reference, prompts: list[list[int]], steps: int = 5, tolerance: float = 1e-4) -> None:
    """Our model steps all `prompts` together (each step's tokens routed to the experts side by side); transformers
    runs each sequence whole. Every step's last logits within `tolerance` of the largest, the same greedy token."""
    session, sequences, new = Session(ours, len(prompts)), [list(p) for p in prompts], prompts
    for _ in range(steps):
        got = session.step(new)
        new = []
        for s, sequence in enumerate(sequences):
            with torch.inference_mode():
                want = reference(torch.tensor([sequence])).logits[0, -1]
            assert (got[s] - want).abs().max().item() < tolerance * max(1.0, want.abs().max().item()), s
            assert int(got[s].argmax()) == int(want.argmax())
            sequence.append(int(want.argmax()))
            new.append([sequence[-1]])


@pytest.mark.parametrize("activations", ["float", "int16"])
def test_qwen3_moe_follows_transformers_with_its_experts_kept_quantized(qwen3_moe, activations, caplog):
    path, kind, reference = qwen3_moe
    with caplog.at_level("INFO", logger="app.model.loader"):
        ours = load_model(ModelSource(path, "gguf", "moe"), "float32", tokenizer=False, activations=activations)
    assert ours.config.architecture == "Qwen3MoeForCausalLM"
    assert (ours.config.num_experts, ours.config.experts_per_token, ours.config.expert_intermediate_size) == \
        (EXPERTS, USED, EXPERT_INTER)
    moe = ours.model.layers[1].mlp
    assert isinstance(moe, MoE) and len(moe.experts) == EXPERTS and moe.top_k == USED
    if kind != "F32":  # every expert in the file's blocks: nothing expanded at load
        assert {lin.weight.type_name for lin in moe.linears()} == {kind}
        assert f"kept quantized: {kind}" in caplog.text and "dequantized" not in caplog.text
    # the native stack routes quantized experts under quantized activations; float32 ones take the Python layers
    native = ours.model._native_stack(ours.model.new_kv_cache(16, 16)) is not None
    assert native == (kind != "F32" and activations == "int16")
    # int16 activations round each row to 16 bits: 1e-3 of the largest logit (measured: just over 1e-4 of it on the
    # Q8_0 experts against transformers 5.24; the dense models' int16 tests allow 2e-2 absolute); float32 1e-4
    tolerance = 1e-4 if activations == "float" else 1e-3
    follow(ours.model, reference, PROMPTS, tolerance=tolerance)
    follow(ours.model, reference, PROMPTS[:1], tolerance=tolerance)  # one sequence: one decode token (MoE's path)


def test_a_step_of_prompt_and_decode_rows_routes_each_as_it_runs_alone(qwen3_moe):
    """One step holds a sequence's decode token and another's next prompt chunk: each expert gets rows of both
    kinds (int16 activations take prompt rows their own way on AVX2), and both sequences still follow
    transformers."""
    path, _, reference = qwen3_moe
    ours = load_model(ModelSource(path, "gguf", "moe"), "float32", tokenizer=False).model
    session = Session(ours, 2)
    first, second = PROMPTS[2][:20], PROMPTS[2][20:]
    session.step([PROMPTS[0], first])
    decode = 33
    got = session.step([[decode], second], prompt_rows=[0, len(second)])
    for row, sequence in ((0, PROMPTS[0] + [decode]), (1, PROMPTS[2])):
        with torch.inference_mode():
            want = reference(torch.tensor([sequence])).logits[0, -1]
        assert (got[row] - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


def test_the_router_renormalizes_the_chosen_weights_only_where_the_model_says():
    """Qwen3-MoE's norm_topk_prob: the k chosen scores rescaled to sum to 1, or left as the softmax gave them."""
    from app.model.layers import MLP
    from app.model.linear import MergedColumnParallelLinear, RowParallelLinear
    from app.parallel.group import SingleRank

    torch.manual_seed(0)
    router = torch.randn(4, 32)
    experts = [MLP(MergedColumnParallelLinear(torch.randn(16, 32), torch.randn(16, 32)),
                   RowParallelLinear(torch.randn(32, 16), SingleRank())) for _ in range(4)]
    x = torch.randn(5, 32)
    scores = torch.softmax(x @ router.T, -1)
    top, chosen = scores.topk(2, -1)
    outputs = torch.stack([e(x) for e in experts], 1)  # [T, experts, H]
    picked = outputs.gather(1, chosen[..., None].expand(-1, -1, 32))
    for renormalize in (True, False):
        weights = top / top.sum(-1, keepdim=True) if renormalize else top
        want = (picked * weights[..., None]).sum(1)
        got = MoE(router, experts, 2, renormalize, SingleRank())(x)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), renormalize


# --- Mixtral: a Hugging Face directory, and a GGUF file written from it as llama.cpp's converter does ---


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(5)
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=EXPERT_INTER,
                           num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                           num_local_experts=EXPERTS, num_experts_per_tok=USED, rms_norm_eps=1e-5,
                           max_position_embeddings=512, tie_word_embeddings=False)
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough that the experts and router matter to the logits
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08 if ".gate." in name else 0.05)
    directory = tmp_path_factory.mktemp("mixtral") / "hf"
    model.save_pretrained(str(directory))
    gguf_path = directory.parent / "gguf" / "mixtral.gguf"
    gguf_path.parent.mkdir()
    _write_mixtral_gguf(directory, gguf_path)
    _write_mixtral_gguf(directory, gguf_path.parent / "per-expert" / "mixtral.gguf", stacked=False)
    return directory, gguf_path, model


def reference_rope_theta(directory: Path) -> float:
    config = json.loads((directory / "config.json").read_text())
    return float((config.get("rope_parameters") or config).get("rope_theta"))


def _write_mixtral_gguf(directory: Path, path: Path, stacked: bool = True) -> None:
    """`stacked`: each layer's experts in one tensor a projection (ffn_gate_exps), as llama.cpp writes them now;
    else one tensor an expert (blk.<i>.ffn_gate.<e>.weight), as older Mixtral files have them."""
    from safetensors.numpy import load_file

    path.parent.mkdir(exist_ok=True)
    tensors = load_file(str(directory / "model.safetensors"))
    w = new_gguf(path, "llama", layers=LAYERS, hidden=HIDDEN, inter=EXPERT_INTER, heads=HEADS, kv_heads=KV_HEADS,
                 vocab=VOCAB, rms_eps=1e-5, context=512, rope_base=reference_rope_theta(directory))
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(USED)

    def rotary_layout(weight: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's interleave of the halves
        return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)

    w.add_tensor("token_embd.weight", tensors["model.embed_tokens.weight"])
    w.add_tensor("output.weight", tensors["lm_head.weight"])
    w.add_tensor("output_norm.weight", tensors["model.norm.weight"])
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", rotary_layout(tensors[p + "self_attn.q_proj.weight"], HEADS))
        w.add_tensor(f"blk.{i}.attn_k.weight", rotary_layout(tensors[p + "self_attn.k_proj.weight"], KV_HEADS))
        w.add_tensor(f"blk.{i}.attn_v.weight", tensors[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", tensors[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_norm.weight", tensors[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", tensors[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", tensors[p + "block_sparse_moe.gate.weight"])
        for kind, hf in (("gate", "w1"), ("down", "w2"), ("up", "w3")):
            experts = [tensors[p + f"block_sparse_moe.experts.{e}.{hf}.weight"] for e in range(EXPERTS)]
            if stacked:
                w.add_tensor(f"blk.{i}.ffn_{kind}_exps.weight", np.stack(experts))
            else:
                for e, weight in enumerate(experts):
                    w.add_tensor(f"blk.{i}.ffn_{kind}.{e}.weight", weight)
    write_gguf(w)


@pytest.mark.parametrize("form", ["safetensors", "gguf", "gguf, an expert a tensor"])
def test_mixtral_follows_transformers(mixtral, form, caplog):
    directory, gguf_path, reference = mixtral
    if form != "safetensors":
        gguf_path = gguf_path if form == "gguf" else gguf_path.parent / "per-expert" / gguf_path.name
    source = ModelSource(directory, "hf", "mixtral") if form == "safetensors" else ModelSource(gguf_path, "gguf", "m")
    ours = load_model(source, "float32", tokenizer=False, activations="float")
    assert ours.config.architecture == "MixtralForCausalLM" and ours.config.norm_topk_prob
    assert isinstance(ours.model.layers[0].mlp, MoE)
    follow(ours.model, reference, PROMPTS)


def test_bfloat16_weights_keep_mixtrals_greedy_choices_mostly(mixtral):
    """bfloat16 weights and activations (the router's scores too, as transformers' bfloat16 model has them):
    logits near the float32 reference's, and most greedy choices the same."""
    directory, _, reference = mixtral
    ours = load_model(ModelSource(directory, "hf", "mixtral"), "bfloat16", tokenizer=False).model
    got = Session(ours, len(PROMPTS)).step(PROMPTS)
    agree = 0
    for s, prompt in enumerate(PROMPTS):
        with torch.inference_mode():
            want = reference(torch.tensor([prompt])).logits[0, -1]
        assert (got[s] - want).abs().max().item() < 0.03 * want.abs().max().item()  # (AMD Zen 3: 0.006-0.009)
        agree += int(got[s].argmax()) == int(want.argmax())
    assert agree >= len(PROMPTS) - 1


def test_a_qwen3_moe_directory_with_a_dense_layer_and_unscaled_weights_follows_transformers(tmp_path):
    """Qwen3-MoE's own config keys: `norm_topk_prob` false (the k chosen weights left as the softmax gave them, as
    transformers does when the key is missing too), `mlp_only_layers` (a dense MLP among the mixtures); and a config
    that leaves `moe_intermediate_size` out still loads, each expert's size read from its weights."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(7)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=384, moe_intermediate_size=128,
                            num_hidden_layers=3, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=64,
                            num_experts=EXPERTS, num_experts_per_tok=USED, norm_topk_prob=False, mlp_only_layers=[1],
                            max_position_embeddings=512, tie_word_embeddings=False)
    reference = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3 if ".gate." in name else 0.05)
    reference.save_pretrained(str(tmp_path / "hf"))
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["norm_topk_prob"] is False
    ours = load_model(ModelSource(tmp_path / "hf", "hf", "moe"), "float32", tokenizer=False).model
    assert [isinstance(layer.mlp, MoE) for layer in ours.layers] == [True, False, True]
    assert not ours.layers[0].mlp.renormalize
    follow(ours, reference, PROMPTS, steps=3)
    del saved["norm_topk_prob"], saved["moe_intermediate_size"]  # transformers' defaults: False, and 768 (not these)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(saved))
    loaded = load_model(ModelSource(tmp_path / "hf", "hf", "moe"), "float32", tokenizer=False)
    assert loaded.config.expert_intermediate_size == 128 and not loaded.config.norm_topk_prob
    follow(loaded.model, reference, PROMPTS[:1], steps=2)


# --- served: the engine at tp=1 and tp=2, what a mixture of experts takes from the plan, what it refuses ---


@pytest.mark.parametrize("tp", [1, 2])
def test_the_engine_serves_a_mixture_of_experts_at_any_tp_as_transformers_scores_it(tp, tmp_path):
    """Through the engine (its scheduler batches the prompts, its ranks run real worker processes): each rank
    runs every expert on its share of their features and one all-reduce sums them; the first token's top-20
    log-probabilities are transformers'."""
    from app.engine.launch import ModelLaunch
    from tests.parallel.test_tp import _replica, assert_served_logprobs_match

    path = tmp_path / "moe.gguf"
    write_qwen3_moe(path, "Q8_0")
    reference = gguf_reference(path, moe_intermediate_size=EXPERT_INTER)
    assert_served_logprobs_match(_replica(tp, model=ModelLaunch(str(path), "gguf", "moe", "float32")), reference,
                                 PROMPTS)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_the_plan_sizes_each_ranks_experts_as_they_load(kind, tmp_path):
    """Each expert's features split over the ranks in whole blocks of 32 (256 at tp=3: 96, 96, 64; Q4_K's down
    projections, cut off their superblocks of 256, load in blocks of 32): what a rank holds, bar the rope table, is
    the plan's figure; nothing is expanded to float32."""
    from app.model.footprint import read_footprint

    path = tmp_path / "m.gguf"
    write_qwen3_moe(path, kind)
    source = ModelSource(path, "gguf", "moe")
    footprint = read_footprint(source)
    assert footprint.expert_intermediate_size == EXPERT_INTER and footprint.params.experts == \
        LAYERS * EXPERTS * 3 * HIDDEN * EXPERT_INTER
    for tp in (1, 2, 3, 4):
        for rank in range(tp):
            loaded = load_model(source, "float32", tokenizer=False, rank=rank, size=tp).model
            held = loaded.resident_bytes() - loaded.cos_sin.numel() * loaded.cos_sin.element_size()
            assert held == footprint.weight_bytes("float32", tp, rank), (tp, rank)
            expert = loaded.layers[0].mlp.experts[0]
            assert expert.down.weight.type_name in (kind, "Q4_M32")  # (Q4_K cut off 256: its blocks of 32)
            assert expert.down.weight.in_features == [96, 96, 64][rank] if tp == 3 else True


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_plan_sizes_a_mixtral_directory_as_it_loads(mixtral, dtype):
    """Safetensors experts and a router of 8 rows (kept a plain tensor in the compute dtype, not packed and
    padded), at tp 1 and 2."""
    from app.model.footprint import read_footprint

    directory, _, _ = mixtral
    source = ModelSource(directory, "hf", "mixtral")
    footprint = read_footprint(source)
    for tp in (1, 2):
        for rank in range(tp):
            loaded = load_model(source, dtype, tokenizer=False, rank=rank, size=tp).model
            assert loaded.layers[0].mlp.router.dtype == loaded.dtype
            held = loaded.resident_bytes() - loaded.cos_sin.numel() * loaded.cos_sin.element_size()
            assert held == footprint.weight_bytes(dtype, tp, rank), (tp, rank)


def test_unsupported_mixtures_say_what_is_supported(tmp_path, mixtral):
    path = tmp_path / "qwen2moe.gguf"
    write_random_gguf(path, "qwen2moe", seed=0, layers=1, hidden=64, inter=128, heads=4, kv_heads=2, vocab=64,
                      experts=4, expert_inter=32)
    with pytest.raises(UnsupportedModel, match="'qwen2moe' is not supported; supported: llama, qwen2, qwen3, qwen3moe"):
        load_model(ModelSource(path, "gguf", "m"), "float32", tokenizer=False)
    directory, _, _ = mixtral
    broken = tmp_path / "broken"
    broken.mkdir()
    config = json.loads((directory / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": EXPERTS + 1}))
    (broken / "model.safetensors").symlink_to(directory / "model.safetensors")
    with pytest.raises(UnsupportedModel, match=f"routes each token to {EXPERTS + 1} of them"):
        load_model(ModelSource(broken, "hf", "m"), "float32", tokenizer=False)
