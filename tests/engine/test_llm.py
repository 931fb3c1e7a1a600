"""The offline API end to end: `from app import LLM, SamplingParams`."""

from __future__ import annotations

import pytest
import torch

from app import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    # bind_threads=False: pinning would confine the whole test process to the rank's CPUs; the exact cache (a float32
    # spec's "auto" takes float16), so that the cache tests below compare with it
    llm = LLM(model={"dtype": "float32"}, kv_cache={"memory": "512MiB", "dtype": "float32"}, bind_threads=False)
    assert llm.core.executor.runner.kv_cache[0][0].dtype == torch.float32
    return llm


def test_chat_answers_the_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"  # the model ended its turn itself
    assert out[0].outputs[0].token_ids[-1] == llm.eos_token_id and "<|im_end|>" not in out[0].outputs[0].text


def test_a_bfloat16_kv_cache_under_float32_activations():
    # kv_cache.dtype may differ from model.dtype: K/V are rounded as they are written (this raised before)
    llm = LLM(model={"dtype": "float32"}, kv_cache={"memory": "256MiB", "dtype": "bfloat16"}, bind_threads=False)
    assert llm.core.executor.runner.kv_cache[0][0].dtype == torch.bfloat16
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out[0].outputs[0].text


def test_a_float16_kv_cache_keeps_the_float32_caches_answers(llm):
    # float16 K/V keep 11 bits of each value (bfloat16: 8): greedy texts stay the float32 cache's (measured over 20
    # prompts x 64 tokens: all identical; a bfloat16 cache changed 2 of them). It is what "auto" takes under float32.
    half = LLM(model={"dtype": "float32"}, kv_cache={"memory": "256MiB"}, bind_threads=False)
    assert half.core.executor.runner.kv_cache[0][0].dtype == torch.float16
    prompts = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in half.generate(prompts, params)]
    assert ours == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_generate_returns_outputs_in_input_order(llm):
    prompts = ["Water boils at", "One, two, three,", "The capital of Italy is"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert [o.prompt for o in outs] == prompts
    single = [llm.generate(p, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text for p in prompts]
    assert [o.outputs[0].text for o in outs] == single
    assert outs[0].prompt_token_ids == llm.tokenizer(prompts[0]).input_ids


def test_token_id_prompts_and_per_prompt_params(llm):
    ids = llm.tokenizer("Count: 1, 2,").input_ids
    outs = llm.generate([ids, "Hello"], [SamplingParams(temperature=0, max_tokens=3),
                                         SamplingParams(temperature=0, max_tokens=5)])
    assert outs[0].prompt is None and outs[0].prompt_token_ids == ids
    assert len(outs[0].outputs[0].token_ids) == 3 and len(outs[1].outputs[0].token_ids) == 5
    assert outs[0].outputs[0].finish_reason == "length"


def test_n_completions_share_the_prompt_and_differ(llm):
    before = llm.core.kv.hits
    prompt = "Write a one-line poem about the ocean, with vivid imagery and a surprising final word:"
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert llm.core.kv.hits - before >= 2 * 16  # siblings found the prompt's full blocks cached
    again = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_stop_strings_never_appear_in_the_text(llm):
    params = SamplingParams(temperature=0, max_tokens=40)
    free = llm.generate("The three primary colors are", params)[0].outputs[0].text
    stop = free.strip().split()[2]  # a word the model does produce
    out = llm.generate("The three primary colors are", SamplingParams(temperature=0, max_tokens=40, stop=(stop,)))
    text = out[0].outputs[0].text
    assert stop not in text and free.startswith(text) and out[0].outputs[0].finish_reason == "stop"


def test_logprobs_of_sampled_and_top_tokens(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 4
    for token, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert len(lp.top) == 3 and lp.top[0][0] == token  # greedy: the sampled token is the most likely
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert lp.logprob <= 0


def test_offline_llm_refuses_more_than_one_replica():
    with pytest.raises(ValueError, match="one replica"):
        LLM(parallel={"dp": 2}, bind_threads=False)


def test_a_rejected_prompt_leaves_the_engine_usable(llm):
    from app.engine.core import RequestRejected

    with pytest.raises(RequestRejected, match="context holds"):
        llm.generate(["Hello", [5] * 9000], SamplingParams(max_tokens=2))
    assert not llm.core.has_work()
    assert llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids


def test_offline_structured_outputs_and_logit_bias(llm):
    """The offline API takes the same grammar the server builds (app.engine.structured.grammar_for) and the same
    logit_bias: n sampled choices each one of the choices given; a bias of 100 on a token makes every output token
    that one."""
    import json

    from app.engine.structured import grammar_for

    choices = ["red", "green", "blue"]
    params = SamplingParams(n=4, temperature=1.2, seed=5, max_tokens=8, grammar=grammar_for("choice", choices))
    out = llm.generate("My favourite colour is", params)[0]
    assert len(out.outputs) == 4 and all(o.text in choices and o.finish_reason == "stop" for o in out.outputs)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    answer = llm.chat([{"role": "user", "content": "Is water wet?"}],
                      SamplingParams(temperature=0, max_tokens=20, grammar=grammar_for("json", schema)))[0]
    assert isinstance(json.loads(answer.outputs[0].text)["ok"], bool)
    banana = llm.tokenizer(" banana", add_special_tokens=False).input_ids
    assert len(banana) == 1
    forced = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, logit_bias={banana[0]: 100}))[0]
    assert forced.outputs[0].text == " banana" * 3


def test_the_models_end_of_turn_token_ends_a_generation_as_eos_does(llm, tmp_path):
    """A GGUF file whose `tokenizer.ggml.eot_token_id` names another token than its EOS (a Llama 3 file whose EOS
    is <|end_of_text|> and whose turns end with <|eot_id|>) stops there as at EOS, as llama.cpp does; ignore_eos
    goes past it. Here a copy of SmolLM2's file names a token of its own greedy answer."""
    import re

    from app.engine.structured import grammar_for
    from app.model.source import resolve_source
    from app.spec.schema import ModelSpec
    from tests.gguf_files import copy_gguf

    prompt, params = "The capital of France is", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = llm.generate(prompt, params)[0].outputs[0].token_ids
    at = next(i for i in range(2, len(reference)) if reference[i] not in reference[:i] and
              reference[i] != llm.eos_token_id)
    path = tmp_path / "eot.gguf"
    copy_gguf(resolve_source(ModelSpec()).path, path, {"tokenizer.ggml.eot_token_id": reference[at]})
    other = LLM(model={"path": str(path), "dtype": "float32"}, kv_cache={"memory": "512MiB", "dtype": "float32"},
                bind_threads=False)
    try:
        assert llm.end_token_ids == () and other.end_token_ids == (reference[at],)
        stopped = other.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
        assert stopped.token_ids == reference[:at + 1] and stopped.finish_reason == "stop"
        assert stopped.text == llm.tokenizer.decode(reference[:at])  # the end token adds no text, as EOS
        assert other.generate(prompt, params)[0].outputs[0].token_ids == reference
        # held by a grammar to that text: where it is complete, the end token ends it as EOS would
        held = other.generate(prompt, SamplingParams(temperature=0, max_tokens=12, grammar=grammar_for(
            "regex", re.escape(stopped.text))))[0].outputs[0]
        assert held.token_ids == reference[:at + 1] and held.finish_reason == "stop" and held.text == stopped.text
    finally:
        other.close()


SCORED = ["The capital of France is Paris, and the capital of Italy is Rome. The capital of Spain is Madrid, and the "
          "capital of Germany is Berlin.",
          "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]


@pytest.fixture(scope="module")
def transformers_model():
    """The independent reference: transformers loading the same GGUF, dequantized by itself."""
    from transformers import AutoModelForCausalLM, GgufConfig

    from app.model.source import resolve_source
    from app.spec.schema import ModelSpec

    path = resolve_source(ModelSpec()).path
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                quantization_config=GgufConfig(gguf_file=path.name,
                                                                               dequantize=True)).eval()


def test_prompt_logprobs_are_transformers_log_probabilities(llm, transformers_model):
    """vLLM's prompt_logprobs: None for the first prompt token, then each next token's log-probability given the ones
    before it (the model's own, as transformers computes them for the same file), its rank, and the k most likely."""
    outs = llm.generate(SCORED, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=4))
    for out in outs:
        ids, scored = out.prompt_token_ids, out.prompt_logprobs
        assert len(scored) == len(ids) and scored[0] is None
        with torch.no_grad():
            reference = transformers_model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        want = reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        got = torch.tensor([lp.logprob for lp in scored[1:]])
        assert (got - want).abs().max() < 0.02  # measured: 0.0004 under int16 activations
        for position, (token, lp) in enumerate(zip(ids[1:], scored[1:], strict=True)):
            top_ids = [t for t, _ in lp.top]
            assert len(lp.top) == 4 and [p for _, p in lp.top] == sorted((p for _, p in lp.top), reverse=True)
            # the top four are transformers' most likely there too (their log-probabilities, within the tolerance)
            assert torch.tensor([p for _, p in lp.top]).sub(reference[position, top_ids]).abs().max() < 0.02
            assert lp.rank == 1 + sum(p > lp.logprob for _, p in lp.top) if lp.rank <= 4 else token not in top_ids
            # its rank: one more than the tokens transformers finds more likely, but for those within the tolerance
            above = [int((reference[position] > want[position] + d).sum()) for d in (0.02, -0.02)]
            assert 1 + above[0] <= lp.rank <= 1 + above[1]


def test_embeddings_are_transformers_last_hidden_states_normalized(llm, transformers_model):
    """LLM.embed (SamplingParams.embed, what /v1/embeddings asks): each prompt's last token's final hidden state
    (after the model's last norm), L2-normalized, as transformers computes it for the same file; a prompt whose
    prefix is cached (the second time) gives the same; two different prompts are different vectors."""
    embedded = llm.embed(SCORED)
    again = llm.embed(SCORED[0])[0]  # its blocks are in the prefix cache now: only the last token is computed
    for ids, vector in zip([llm.tokenizer(t).input_ids for t in SCORED], embedded, strict=True):
        with torch.no_grad():
            hidden = transformers_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        want = torch.nn.functional.normalize(hidden, dim=0)
        got = torch.tensor(vector)
        assert got.shape == want.shape == (576,) and abs(float(got.norm()) - 1) < 1e-5
        assert float(got @ want) > 0.999, float(got @ want)  # cosine similarity to transformers'
    assert float(torch.tensor(again) @ torch.tensor(embedded[0])) > 0.9999
    assert float(torch.tensor(embedded[0]) @ torch.tensor(embedded[1])) < 0.99


def test_scores_are_the_cosines_of_transformers_embeddings(llm, transformers_model):
    """LLM.score (vLLM's, for an embedding model): each pair's cosine of the two texts' last-token final hidden
    states, as transformers computes them; one text against many, or one to one; uneven sides are a ValueError."""
    texts = ["The cat sat on the mat.", "A cat was sitting on a rug.", "Stock markets fell sharply today."]
    with torch.no_grad():
        hidden = [transformers_model(torch.tensor([llm.tokenizer(t).input_ids]),
                                     output_hidden_states=True).hidden_states[-1][0, -1] for t in texts]
    want = [[float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for b in hidden] for a in hidden]
    assert llm.score(texts[0], texts[1:]) == pytest.approx(want[0][1:], abs=2e-3)
    assert llm.score(texts[:2], [texts[2], texts[0]]) == pytest.approx([want[0][2], want[1][0]], abs=2e-3)
    assert want[0][1] > want[0][2]  # (the paraphrase nearer than the unrelated text, in the reference too)
    with pytest.raises(ValueError, match="2 with 3"):
        llm.score(texts[:2], texts)


def test_mean_and_first_token_pooling_through_chunks_and_preemption(llm, transformers_model, tmp_path):
    """model.pooling "mean" (here read from a GGUF copy whose `llama.pooling_type` says 1, llama.cpp's mean) and
    "cls": each prompt's embedding is the mean (or the first) of transformers' final hidden states of every prompt
    token, L2-normalized, though the prompts are prefilled 16 tokens a step, and one of them is in the prefix cache
    (such a request computes its prompt whole: a cached token's hidden state was never kept). Preempted halfway:
    test_engine's runner test."""
    from app.model.source import resolve_source
    from app.spec.schema import ModelSpec
    from tests.gguf_files import copy_gguf

    path = tmp_path / "mean.gguf"
    copy_gguf(resolve_source(ModelSpec()).path, path, {"llama.pooling_type": 1})
    texts = [*SCORED, "The quick brown fox jumps over the lazy dog. " * 9, "One, two, three, four, five. " * 9]
    want = {}
    for ids in [llm.tokenizer(t).input_ids for t in texts]:
        with torch.no_grad():
            hidden = transformers_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        want.setdefault("mean", []).append(torch.nn.functional.normalize(hidden.mean(dim=0), dim=0))
        want.setdefault("cls", []).append(torch.nn.functional.normalize(hidden[0], dim=0))
        want.setdefault("last", []).append(torch.nn.functional.normalize(hidden[-1], dim=0))
    for chosen in ("auto", "cls"):
        small = LLM(model={"path": str(path), "dtype": "float32", "max_model_len": 128, "pooling": chosen},
                    kv_cache={"memory": "7MiB", "dtype": "float32"},
                    scheduler={"max_num_batched_tokens": 16, "max_num_seqs": 4, "step_time_budget": 0},
                    bind_threads=False)
        try:
            pooling = "mean" if chosen == "auto" else chosen
            assert small.pooling == pooling
            small.generate(texts[0], SamplingParams(temperature=0, max_tokens=1))  # its prompt's blocks now cached
            got = small.embed(texts)
            assert small.core.kv.hits == 0  # texts[0] took no hit
        finally:
            small.close()
        for vector, mean, other in zip(got, want[pooling], want["last"], strict=True):
            vector = torch.tensor(vector)
            assert abs(float(vector.norm()) - 1) < 1e-5
            assert float(vector @ mean) > 0.999, (pooling, float(vector @ mean))  # cosine similarity
            assert float(vector @ other) < 0.99  # not the last token's


def test_n_choices_score_their_prompt_once_and_share_its_blocks(llm):
    """n = 4 with prompt_logprobs: the first choice scores the prompt (computed whole), the other three share its
    cached blocks (a prefix-cache hit each), and the prompt's logprobs are those of n = 1."""
    kv = llm.core.kv
    one = llm.generate(SCORED[1], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    hits = kv.hits
    four = llm.generate(SCORED[1], SamplingParams(n=4, temperature=0.8, seed=3, max_tokens=2, prompt_logprobs=1))[0]
    assert kv.hits - hits >= 3 * (len(four.prompt_token_ids) - kv.block_size) > 0  # (whole blocks only)
    for a, b in zip(one.prompt_logprobs[1:], four.prompt_logprobs[1:], strict=True):
        assert b.logprob == pytest.approx(a.logprob, abs=1e-4) and [t for t, _ in b.top] == [t for t, _ in a.top]
    assert len(four.outputs) == 4
    # a request's own count, as vLLM's RequestOutput.num_cached_tokens: whole blocks, none with prompt logprobs (the
    # first choice computes the prompt whole) and the prompt's once for its n choices
    assert one.num_cached_tokens == four.num_cached_tokens == 0
    again = llm.generate(SCORED[1], SamplingParams(n=2, temperature=0, max_tokens=2))[0]
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // kv.block_size * kv.block_size > 0


def test_prompt_logprobs_through_chunks_and_preemption(llm):
    """A prompt prefilled in chunks of 16 tokens, under preemptions (here after the prompts; one halfway through a
    prompt: test_engine's runner test), gives every position's logprob once, as one pass does; a prompt-scoring
    request takes no prefix-cache hit (its cached tokens' logits were never computed: it would miss positions)."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, prompt_logprobs=2)
    whole = llm.generate(SCORED, params)
    small = LLM(model={"dtype": "float32", "max_model_len": 128}, kv_cache={"memory": "7MiB", "dtype": "float32"},
                scheduler={"max_num_batched_tokens": 16, "max_num_seqs": 4, "step_time_budget": 0}, bind_threads=False)
    try:
        small.generate(SCORED[0], SamplingParams(temperature=0, max_tokens=1))  # its prompt's blocks now cached
        outs = small.generate(SCORED, params)
        assert small.core.scheduler.num_preemptions > 0
    finally:
        small.close()
    for one, other in zip(whole, outs, strict=True):
        assert len(other.prompt_logprobs) == len(one.prompt_logprobs) and other.prompt_logprobs[0] is None
        for a, b in zip(one.prompt_logprobs[1:], other.prompt_logprobs[1:], strict=True):
            assert b.logprob == pytest.approx(a.logprob, abs=1e-3) and [t for t, _ in b.top] == [t for t, _ in a.top]


def test_generate_without_params_samples_with_the_models_and_the_specs_defaults(llm, tmp_path):
    """vLLM's LLM.get_default_sampling_params: a file whose general.sampling says greedy, and the spec's max_tokens,
    answer generate() without params: the greedy text of the shared LLM (the same numerics), 5 tokens long."""
    from app.model.source import resolve_source
    from app.spec.schema import ModelSpec
    from tests.gguf_files import copy_gguf

    path = tmp_path / "greedy.gguf"
    copy_gguf(resolve_source(ModelSpec()).path, path, {"general.sampling.temp": 0.0})
    greedy = LLM(model={"path": str(path), "dtype": "float32", "max_model_len": 256,
                        "sampling_defaults": {"max_tokens": 5}},
                 kv_cache={"memory": "64MiB", "dtype": "float32"}, bind_threads=False)
    try:
        assert greedy.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
        got = greedy.generate("The capital of France is")[0].outputs[0]
    finally:
        greedy.close()
    want = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert got.token_ids == want.token_ids and len(got.token_ids) == 5
