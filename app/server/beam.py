"""vLLM's beam search (`use_beam_search`), on both generation endpoints, as vLLM's server runs it: each step asks the
engine for one token of every live beam with its 2 x width most likely next tokens (the prompt and the beams'
common tokens come from the prefix cache), keeps the `width` likeliest extensions, and sets aside those that end
(an end-of-generation token); the answer is the `width` best of all by vLLM's score, the summed log-probability over
(prompt + output tokens) ** length_penalty. Unlike vLLM it stops early where it has `width` ended beams and the best
live one scores below all of them (transformers' heuristic), rather than always running to max_tokens."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from app.engine.params import SamplingParams
from app.server.errors import APIError
from app.server.generation import Generation

MAX_WIDTH = 10  # 2 x width candidates a beam: the engine gives at most 20 most likely tokens
# the request fields beam search does not follow, each with the values that mean "off" (set otherwise: a 400)
CONFLICTS: dict[str, tuple] = {
    "stream": (False,), "logprobs": (None, False), "top_logprobs": (None, 0), "prompt_logprobs": (None,),
    "echo": (False, None), "stop": (None, [], ""), "stop_token_ids": (None, []), "min_tokens": (0,),
    "logit_bias": (None, {}), "allowed_token_ids": (None,), "bad_words": (None, []), "response_format": (None,),
    "structured_outputs": (None,), "tools": (None, []), "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0), "include_stop_str_in_output": (False,),
}


@dataclass
class Beam:
    tokens: list[int]  # the output so far (an ended beam's end token last)
    logprob: float = 0.0  # their summed log-probability
    ended: bool = False  # by an end-of-generation token: finish_reason "stop"

    def score(self, prompt_length: int, length_penalty: float) -> float:
        """vLLM's: the summed log-probability over the sequence's length (prompt and output, the end token not
        counted) to the power length_penalty."""
        return self.logprob / (prompt_length + len(self.tokens) - self.ended) ** length_penalty

    def text_ids(self) -> list[int]:
        return self.tokens[:-1] if self.ended else self.tokens


def check_beam_request(body) -> None:
    """400 for what beam search cannot honour: a field it would ignore (it answers from the model's log-probabilities
    alone), or more beams than it can ask the engine's logprobs for."""
    for name, off in CONFLICTS.items():
        if name in type(body).model_fields and getattr(body, name) not in off:
            raise APIError(400, f"{name} cannot be combined with use_beam_search", name, "invalid_value")
    if body.n > MAX_WIDTH:
        raise APIError(400, f"n (the beam width with use_beam_search) must be at most {MAX_WIDTH}", "n",
                       "invalid_value")


async def beam_search(ctx, request: Request, prompt_ids: list[int], width: int, max_tokens: int,
                      length_penalty: float, ignore_eos: bool) -> list[Beam]:
    """The `width` best beams of at most `max_tokens` tokens after `prompt_ids`, best first."""
    from app.server.openai_api import add_prompt, collect, start_generation

    ends = set() if ignore_eos else {ctx.eos_token_id, *ctx.end_token_ids} - {None}
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
    live, ended = [Beam([])], []
    for _ in range(max_tokens):
        gen = Generation(ctx.engine, ctx.metrics, ctx.tokenizer, params, ctx.eos_token_id, "beam")
        for beam in live:
            add_prompt(gen, prompt_ids + beam.tokens, 1, 1)
        await start_generation(gen)
        await collect(gen, request)
        candidates = []
        for beam, seq in zip(live, gen.sequences, strict=True):
            for token, logprob in seq.text.logprobs[0].top:
                grown = Beam(beam.tokens + [token], beam.logprob + logprob, token in ends)
                (ended if grown.ended else candidates).append(grown)
        live = sorted(candidates, key=lambda b: -b.logprob)[:width]
        best = sorted(ended, key=lambda b: -b.score(len(prompt_ids), length_penalty))[:width]
        if not live or (len(best) == width and live[0].score(len(prompt_ids), length_penalty) <
                        best[-1].score(len(prompt_ids), length_penalty)):
            break
    return sorted(ended + live, key=lambda b: -b.score(len(prompt_ids), length_penalty))[:width]


def usage(prompt_ids: list[int], beams: list[Beam]) -> dict:
    output = sum(len(b.text_ids()) for b in beams)  # (an ended beam's end token not counted, as vLLM's)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": output, "total_tokens": len(prompt_ids) + output}


async def completion_answer(ctx, request: Request, body, prompts: list[list[int]]) -> dict:
    """A completion request's answer by beam search: `n` beams of each prompt, best first."""
    import time

    choices, counted = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for ids in prompts:
        limit = ctx.output_limit(ids, body.max_tokens, "max_tokens", "prompt")
        beams = await beam_search(ctx, request, ids, body.n, limit, body.length_penalty, body.ignore_eos)
        for beam in beams:
            choices.append({"index": len(choices), "text": await _text(ctx, beam, body), "logprobs": None,
                            "finish_reason": "stop" if beam.ended else "length",
                            "stop_reason": beam.tokens[-1] if beam.ended else None})
        counted = {k: counted[k] + v for k, v in usage(ids, beams).items()}
    return {"id": f"cmpl-{body.request_id or _id()}", "object": "text_completion", "created": int(time.time()),
            "model": ctx.served_name, "choices": choices, "usage": counted}


async def chat_answer(ctx, request: Request, body, ids: list[int], param: str) -> dict:
    """A chat request's answer by beam search: `n` beams, best first, each a plain assistant message."""
    import time

    limit = ctx.output_limit(ids, body.output_limit(), param, "messages")
    beams = await beam_search(ctx, request, ids, body.n, limit, body.length_penalty, body.ignore_eos)
    choices = [{"index": i, "message": {"role": "assistant", "content": await _text(ctx, beam, body)},
                "logprobs": None, "finish_reason": "stop" if beam.ended else "length",
                "stop_reason": beam.tokens[-1] if beam.ended else None}
               for i, beam in enumerate(beams)]
    return {"id": f"chatcmpl-{body.request_id or _id()}", "object": "chat.completion", "created": int(time.time()),
            "model": ctx.served_name, "choices": choices, "usage": usage(ids, beams)}


async def _text(ctx, beam: Beam, body) -> str:
    return await ctx.text.run(lambda: ctx.tokenizer.decode(beam.text_ids(),
                                                           skip_special_tokens=body.skip_special_tokens))


def _id() -> str:
    import uuid

    return uuid.uuid4().hex
