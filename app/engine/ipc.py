"""The messages between HTTP frontend workers and an engine process, over ZeroMQ.

msgpack via msgspec with a closed set of tagged structs: decoding checks every field's type, and
nothing from a socket is ever unpickled. A frontend worker is a DEALER (its identity names it);
the engine is a ROUTER that answers each worker on its own identity. Heartbeats go out on a separate
PUB socket from their own thread, so that a long step cannot look like a dead engine.
"""

from __future__ import annotations

import msgspec

from app.engine.params import SamplingParams


class AddRequest(msgspec.Struct, tag="add", frozen=True):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # a dataclass: msgspec checks its field types and runs its own checks on decode
    eos_token_id: int | None = None
    wait_for: str | None = None


class Abort(msgspec.Struct, tag="abort", frozen=True):
    request_ids: list[str]


class Delta(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    token_id: int | None
    logprob: float | None
    top: list[tuple[int, float]] | None
    finish_reason: str | None
    prompt_tokens: int
    output_tokens: int
    # with the first token of a request that asked for prompt logprobs: None for the prompt's first token, then
    # (logprob, top, rank) for each next one
    prompt_logprobs: list[tuple[float, list[tuple[int, float]], int] | None] | None = None
    embedding: list[float] | None = None  # with the first token of a request that asked for its embedding
    timings: tuple[float, float] | None = None  # with the first token: seconds queued, then to that token (engine's)
    cached_tokens: int | None = None  # with the first token: prompt tokens found in the prefix cache


class Outputs(msgspec.Struct, tag="outputs", frozen=True):
    deltas: list[Delta]


class Accepted(msgspec.Struct, tag="accepted", frozen=True):
    """The engine queued the request (sent before any of its tokens)."""

    request_id: str


class Rejected(msgspec.Struct, tag="rejected", frozen=True):
    request_id: str
    status: int  # the HTTP status the frontend should answer with
    message: str


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    ready: bool
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    draft_tokens: int = 0  # speculative decoding: drafts computed, and those kept
    accepted_tokens: int = 0
    draining: bool = False  # finishing its requests before it exits (a spec reload restarts it): route elsewhere
    incarnation: int = 0  # the engine process's pid: a new one means it was restarted, and what was in flight is lost
    # seconds from this beat on that the engine may go unheard and is not lost for it: a build that holds the GIL
    # (llguidance's tokenizer, right after ready), which the heartbeat thread needs
    quiet_for: float = 0.0
    max_num_seqs: int = 0  # the sequences it runs at once (llama.cpp's /props counts them as slots)


ToEngine = AddRequest | Abort
FromEngine = Outputs | Accepted | Rejected | Heartbeat

encoder = msgspec.msgpack.Encoder()
decode_to_engine = msgspec.msgpack.Decoder(ToEngine).decode
decode_from_engine = msgspec.msgpack.Decoder(FromEngine).decode


def heartbeat_address(address: str) -> str:
    """Where an engine publishes its heartbeats: beside its request socket."""
    return address + "-heartbeat"
