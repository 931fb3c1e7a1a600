"""How to sample one request's output: the knobs of OpenAI's and vLLM's APIs, checked on creation."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# How an embedding pools a prompt's final hidden states (SamplingParams.pooling, the spec's model.pooling)
POOLINGS = ("last", "mean", "cls")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Completions to generate from the prompt (they share the prompt's KV blocks)."""
    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 or -1: all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    repetition_penalty: float = 1.0
    """Tokens seen in the prompt or output: positive logits divided by it, negative ones multiplied."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it appears in the output."""
    presence_penalty: float = 0.0
    """Subtracted from a token's logit if it appears in the output at all."""
    seed: int | None = None
    """Makes this request's sampling reproducible, whatever else is in the batch."""
    max_tokens: int | None = 16
    """Most tokens to generate (None: until the context is full)."""
    min_tokens: int = 0
    """EOS and stop token ids are not sampled before this many tokens; stop strings count only where they end
    in a later token's text (as vLLM's)."""
    ignore_eos: bool = False
    """Keep generating past EOS."""
    stop: tuple[str, ...] = ()
    """Stop when the output text contains one of these; the stop string itself is not returned unless
    include_stop_str_in_output."""
    include_stop_str_in_output: bool = False
    """The stop string that ended the text is its last part (vLLM's); nothing is held back while streaming."""
    stop_token_ids: tuple[int, ...] = ()
    """Stop after sampling one of these token ids (the token is not returned in the text)."""
    logprobs: int | None = None
    """Return the log-probability of each sampled token and of this many most likely tokens."""
    prompt_logprobs: int | None = None
    """Return the log-probability of each prompt token after the first, given the tokens before it, and of this
    many most likely tokens at its position (vLLM's prompt_logprobs; the first token has none). Such a request
    computes its whole prompt: it takes no prefix-cache hit, whose tokens' logits were never computed."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output text."""
    keep_special_ids: tuple[int, ...] = ()
    """Special tokens written into the text even where skip_special_tokens leaves the others out: the tags a
    tool-call or thinking-block reader looks for, where a tokenizer marks them special (Hermes 2 Pro's
    `<tool_call>`; vLLM turns skip_special_tokens off for its Hermes parser instead)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, each bias from -100 to 100 added to that token's logit before penalties and sampling
    (OpenAI's logit_bias; -100 all but bans a token, 100 all but forces it). A dict {token id: bias} is taken too."""
    allowed_token_ids: tuple[int, ...] = ()
    """Only these tokens may be sampled (vLLM's allowed_token_ids; EOS too only if listed): every other token's logit
    is -inf before logit_bias, penalties and the grammar; log-probabilities stay the model's own. Empty: all."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """Token sequences the output never ends with (vLLM's bad_words, as its tokenizer's ids: the frontend gives each
    word's ids with and without a leading space): a sequence's last token is -inf wherever the output's last tokens
    are the rest of it (a one-token sequence: always), before logit_bias and penalties."""
    grammar: str | None = None
    """An llguidance grammar the output must follow (app/engine/structured.py `grammar_for` makes one from a JSON
    schema, a regular expression, a list of choices or a Lark grammar); it ends where the grammar is complete."""
    embed: bool = False
    """Give the prompt's embedding with the first token: its final hidden states (after the model's last norm)
    pooled as `pooling` says, L2-normalized; the /v1/embeddings endpoint's."""
    pooling: str = "last"
    """How `embed` pools: "last" takes the last prompt token's hidden state (vLLM's default pooling for a decoder
    model), "mean" the mean of every prompt token's, "cls" the first token's. "mean" and "cls" compute the whole
    prompt (no prefix-cache hit: a cached token's hidden state was never kept)."""
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(token), float(value)) for token, value in bias))
        checks = [
            (self.n >= 1, "n must be at least 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= -1, "top_k must be -1, 0 (all tokens) or positive"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens must be <= max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be between 0 and 20"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "prompt_logprobs must be between 0 and 20"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias),
             "logit_bias must map token ids (>= 0) to biases from -100 to 100"),
            (len({t for t, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias names a token id twice"),
            (all(t >= 0 for t in self.allowed_token_ids), "allowed_token_ids must be token ids (>= 0)"),
            (all(word and all(t >= 0 for t in word) for word in self.bad_words_token_ids),
             "bad_words_token_ids must be non-empty sequences of token ids (>= 0)"),
            (self.pooling in POOLINGS, f"pooling must be one of {', '.join(POOLINGS)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if 0 < self.temperature < 1e-5:  # dividing by this would overflow: it means greedy (as vLLM does)
            object.__setattr__(self, "temperature", 0.0)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "keep_special_ids", tuple(self.keep_special_ids))
        object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(word) for word in self.bad_words_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's tokens get their logprobs (prompt_logprobs, 0 included): the whole prompt is
        computed (no prefix-cache hit) and the head's logits taken for every prompt row."""
        return self.prompt_logprobs is not None

    @property
    def whole_prompt(self) -> bool:
        """Whether the request computes its whole prompt, taking no prefix-cache hit: it scores its prompt, or
        pools every prompt token's hidden state (or the first one's) into its embedding."""
        return self.scores_prompt or (self.embed and self.pooling != "last")

    def for_choice(self, index: int) -> SamplingParams:
        """The params of choice `index` (0 to n-1) of one prompt: with a seed, each choice gets its own
        (seed + index), so the n choices differ and every one is reproducible, offline and served alike. Only the
        first choice scores the prompt (prompt_logprobs): its logprobs are every choice's, and the others share its
        prompt's KV blocks rather than compute the prompt whole again (n = 16 had taken 11x one choice's time)."""
        if index == 0:
            return self
        seed = None if self.seed is None else (self.seed + index) % 2**64
        return replace(self, seed=seed, prompt_logprobs=None)
