"""SmolLM2-135M-Instruct through our model against Hugging Face transformers loading the same GGUF.

transformers (with gguf and accelerate) dequantizes the file itself and runs its own Llama code: an
independent reference for the loader (Q/K un-permutation, tied embeddings) and for every kernel,
the kept-quantized linears included.
"""

from __future__ import annotations

import pytest
import torch

from app.model.batch import make_batch
from app.model.loader import load_model
from app.model.source import ModelSource, resolve_source
from app.model.tokenizer import load_tokenizer
from app.spec.schema import ModelSpec

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "<|im_start|>user\nWhat are three good reasons to learn a second language?<|im_end|>\n<|im_start|>assistant\n",
    "1, 1, 2, 3, 5, 8, 13,",
]
STEPS = 64


@pytest.fixture(scope="module")
def source() -> ModelSource:
    return resolve_source(ModelSpec())


@pytest.fixture(scope="module")
def reference(source):
    from transformers import AutoModelForCausalLM, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=source.path.name, dequantize=True))
    return model.eval()


@pytest.fixture(scope="module", params=["keep", "dequantize"])
def ours_fp32(source, request):
    """float32 arithmetic on the file's Q4_1/Q8_0 blocks as they are ("keep" with "float" activations), or on
    weights expanded to float32 at load: both must match transformers, which expands them itself."""
    return load_model(source, "float32", quantized=request.param, activations="float")


@pytest.fixture(scope="module")
def ours_int16(source):
    """The default: activations quantized per block to about 16 bits, int8 dot products on the kept blocks."""
    return load_model(source, "float32", tokenizer=False)


@pytest.fixture(scope="module")
def prompt_ids(source):
    tokenizer = load_tokenizer(source)
    return [tokenizer(p).input_ids for p in PROMPTS]


class Session:
    """Greedy generation for a few sequences through our model and a paged cache with shuffled blocks."""

    def __init__(self, model, seqs: int, block_size: int = 16, capacity: int = 256):
        per_seq = -(-capacity // block_size)
        order = torch.randperm(per_seq * seqs, generator=torch.Generator().manual_seed(0)).tolist()
        self.blocks = [order[i * per_seq:(i + 1) * per_seq] for i in range(seqs)]
        self.model, self.block_size = model, block_size
        self.cache = model.new_kv_cache(per_seq * seqs, block_size)
        self.tokens: list[list[int]] = [[] for _ in range(seqs)]

    def step(self, new: list[list[int]], prompt_rows: list[int] | None = None) -> torch.Tensor:
        """Run `new[s]` more tokens of each sequence (`prompt_rows[s]` of them prompt tokens: by default all of
        several, none of one); returns the logits of each one's last token."""
        return self.model.logits(self.rows(new, prompt_rows))

    def rows(self, new: list[list[int]], prompt_rows: list[int] | None = None) -> torch.Tensor:
        """As `step`, but each sequence's last hidden row (the layers' output, before the head)."""
        done = [len(t) for t in self.tokens]
        batch = make_batch(self.blocks, done, [len(n) for n in new], self.block_size, prompt_rows)
        ids = torch.tensor([tok for n in new for tok in n])
        for t, n in zip(self.tokens, new, strict=True):
            t.extend(n)
        return self.model.forward(ids, batch, self.cache)[batch.logit_indices]

    def greedy(self, prompts: list[list[int]], steps: int) -> list[list[int]]:
        logits = self.step(prompts)
        out = [[] for _ in prompts]
        for _ in range(steps):
            nxt = logits.argmax(-1).tolist()
            for o, tok in zip(out, nxt, strict=True):
                o.append(tok)
            logits = self.step([[tok] for tok in nxt])
        return out


def assert_follows(ours, reference, ids: list[int], steps: int = 6, tolerance: float = 1e-4) -> None:
    """Both models fed the reference's greedy tokens from the prompt `ids`: every step's logits within `tolerance`
    (relative to the largest), and the same greedy token."""
    ours_session, reference_session, new = Session(ours, 1), Session(reference, 1), [ids]
    for _ in range(steps):
        got, want = ours_session.step(new)[0], reference_session.step(new)[0]
        assert (got - want).abs().max().item() < tolerance * max(1.0, want.abs().max().item())
        assert got.argmax() == want.argmax()
        new = [[int(want.argmax())]]


def reference_greedy(model, ids: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' own forward with its KV cache; returns the prompt's last logits and the tokens."""
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        first, past, tokens = out.logits[0, -1].clone(), out.past_key_values, []
        for _ in range(steps):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
    return first, tokens


@pytest.fixture(scope="module")
def reference_runs(reference, prompt_ids):
    return [reference_greedy(reference, ids, STEPS) for ids in prompt_ids]


def test_fp32_last_logits_match_transformers(ours_fp32, prompt_ids, reference_runs):
    logits = Session(ours_fp32.model, len(prompt_ids)).step(prompt_ids)  # all five prompts in one batch
    for row, (expected, _) in zip(logits, reference_runs, strict=True):
        assert (row - expected).abs().max().item() < 1e-3


def test_fp32_greedy_64_tokens_match_transformers(ours_fp32, prompt_ids, reference_runs):
    generated = Session(ours_fp32.model, len(prompt_ids)).greedy(prompt_ids, STEPS)
    for mine, (_, expected) in zip(generated, reference_runs, strict=True):
        assert mine == expected


def test_int16_activations_stay_within_reach_of_transformers(ours_int16, prompt_ids, reference_runs):
    """Quantized activations move logits by a few thousandths (float32: 1e-4); the greedy tokens stay."""
    logits = Session(ours_int16.model, len(prompt_ids)).step(prompt_ids)
    for row, (expected, _) in zip(logits, reference_runs, strict=True):
        assert (row - expected).abs().max().item() < 2e-2
    generated = Session(ours_int16.model, len(prompt_ids)).greedy(prompt_ids, STEPS)
    for mine, (_, expected) in zip(generated, reference_runs, strict=True):
        assert mine == expected


def top1_agreement(model, prompt_ids, reference, reference_runs) -> float:
    """Teacher-forced: the reference's greedy continuation fed in; how often our argmax equals its argmax."""
    agree = total = 0
    for ids, (_, continuation) in zip(prompt_ids, reference_runs, strict=True):
        sequence = ids + continuation
        with torch.inference_mode():
            expected = reference(torch.tensor([sequence])).logits[0].argmax(-1)
        session = Session(model, 1)
        batch = make_batch(session.blocks, [0], [len(sequence)], session.block_size)
        hidden = model.forward(torch.tensor(sequence), batch, session.cache)
        mine = model.logits(hidden).argmax(-1)
        agree += int((mine == expected).sum())
        total += len(sequence)
    return agree / total


@pytest.mark.parametrize(("dtype", "activations", "floor"), [("bfloat16", "int16", 0.98), ("float32", "int16", 0.995),
                                                             ("float32", "int8", 0.965)])
def test_top1_agrees_on_teacher_forced_positions(source, prompt_ids, reference, reference_runs, dtype, activations,
                                                 floor):
    """bfloat16 activations and int8 ones (as llama.cpp's) drift further than int16; they must stay close."""
    ours = load_model(source, dtype, tokenizer=False, activations=activations)
    agreement = top1_agreement(ours.model, prompt_ids, reference, reference_runs)
    assert agreement >= floor, f"top-1 agreement {agreement:.4f}"


def test_chat_template_comes_from_the_file(ours_fp32):
    assert ours_fp32.chat_template and "<|im_start|>" in ours_fp32.chat_template
    text = ours_fp32.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "Hi<|im_end|>" in text
