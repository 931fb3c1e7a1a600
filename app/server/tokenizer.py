"""The tokenizer as a frontend worker uses it: large inputs off the event loop, hopeless ones refused early.

Chat templating (Jinja, pure Python) and tokenizing a few hundred KiB take tens of milliseconds; on
the event loop that delays every other request of the worker, `/health` included. So all of it runs
on one worker thread (one: a Hugging Face fast tokenizer may reconfigure itself on a call, which two
threads must not do at once; the hop costs tens of microseconds). Text longer than the context could hold in any tokenization
(`max_text_chars`: the longest vocabulary entry times the context length) is refused before any of
it is tokenized, so a multi-MiB body costs nothing but its read.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from app.server.errors import APIError
from app.server.reasoning import CLOSE, OPEN, template_thinks
from app.server.tools import ARGS_TAG, CALL_ID_TAG, HERMES_TAGS, MISTRAL_TAG

class AsyncTokenizer:
    CHECKED = 64  # grammars remembered as checked

    def __init__(self, tokenizer, max_model_len: int, chat_template: str | None, reasoning: str = "auto"):
        self.tokenizer, self.max_model_len, self.chat_template = tokenizer, max_model_len, chat_template
        self.eos_token_id = tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)
        # every token covers at most this many characters, so longer text surely overflows the context
        longest = max((len(piece) for piece in tokenizer.get_vocab()), default=1)
        self.max_text_chars = max(longest, 1) * max_model_len
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self._grammar_tokenizer = None  # llguidance's view of the tokenizer (`warm_grammars`), on the pool's thread
        # grammars already checked, most recently used last: a client sends the same schema or tools every turn
        # (128 functions' schemas take ~25 ms to check on this thread)
        self._checked: OrderedDict[str, str | None] = OrderedDict()  # grammar -> why it was refused, or None
        # the variables the template reads (None: unknown), so whether it renders `tools` (app/server/tools.py
        # writes them into a system message otherwise), and which chat_template_kwargs it can use
        template = chat_template or getattr(tokenizer, "chat_template", None)
        self.template_variables = template_variables(template)
        # of a tokenizer's named templates, what those that render a conversation read (transformers picks "tool_use"
        # where tools are given, else "default": Command R's "rag" never renders here), by whether tools are given
        self.rendering_variables = {False: self.template_variables, True: self.template_variables}
        if isinstance(template, dict):
            self.rendering_variables = {False: template_variables(template.get("default")),
                                        True: template_variables(template.get("tool_use") or template.get("default"))}
        self.tool_format = tool_format(template, self.template_knows_tools)
        # whether the template has a "developer" role of its own; if not, those messages become system ones (vLLM's
        # way: OpenAI's newer clients send the developer role where older ones sent system)
        texts = template.values() if isinstance(template, dict) else [template or ""]
        self.template_knows_developer = any('"developer"' in t or "'developer'" in t for t in texts)
        # whether answers' <think> blocks come back apart (app/server/reasoning.py)
        self.thinks = reasoning == "auto" and template_thinks(template)
        # those of the answer readers' tags that this tokenizer marks special: a decode that skips special tokens
        # would leave them out (Hermes 2 Pro's <tool_call>), so a request whose reader looks for them keeps them
        special = {token.content: i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
                   if token.special}
        self.special_tags = {tag: special[tag] for tag in (*HERMES_TAGS, MISTRAL_TAG, ARGS_TAG, CALL_ID_TAG, OPEN,
                                                           CLOSE) if tag in special}

    def kept_tags(self, tool_format: str | None, thinking: bool) -> tuple[int, ...]:
        """The special token ids of the tags an answer's readers look for (SamplingParams.keep_special_ids): the
        tool calls' of the format they are read in (None: no calls read), and the thinking block's."""
        tags = {"hermes": HERMES_TAGS, "qwen3_xml": HERMES_TAGS, "mistral": (MISTRAL_TAG,),
                "mistral_args": (MISTRAL_TAG, ARGS_TAG, CALL_ID_TAG)}.get(tool_format or "", ())
        tags = (*tags, *((OPEN, CLOSE) if thinking else ()))
        return tuple(self.special_tags[tag] for tag in tags if tag in self.special_tags)

    @property
    def template_knows_tools(self) -> bool:
        """Whether the template renders `tools` (one Jinja cannot read here is taken to)."""
        return self.template_variables is None or "tools" in self.template_variables

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def warm_grammars(self) -> None:
        """Build llguidance's view of the tokenizer now (the server's start), on the tokenizer's thread, rather than
        for the first structured output: ~0.4 s for SmolLM2, holding the GIL, which every request of the worker,
        `/health` included, would wait for then."""
        self._pool.submit(self._grammar_tokenizer_built)

    def _grammar_tokenizer_built(self):
        from app.engine.structured import tokenizer_from_json

        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = tokenizer_from_json(self.tokenizer.backend_tokenizer.to_str(), self.vocab_size,
                                                          self.eos_token_id)
        return self._grammar_tokenizer

    async def encode(self, text: str, param: str, add_special_tokens: bool = True, bounded: bool = True) -> list[int]:
        """`bounded`: a text too long to fit the context in any tokenization is refused before it is tokenized (not
        where the request keeps only its last tokens, truncate_prompt_tokens: the body's size bounds it then)."""
        if bounded:
            self.check_length(len(text), param)
        return await self._run(lambda: self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    async def bad_words(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as token ids (SamplingParams.update_from_tokenizer): each word without and with a leading
        space (its leading whitespace dropped first), the second kept where it differs from the first in its first
        token and has as many tokens (a word that starts a text and one inside it)."""
        def tokenize() -> tuple[tuple[int, ...], ...]:
            found: list[tuple[int, ...]] = []
            for word in words:
                plain = tuple(self.tokenizer(word.lstrip(), add_special_tokens=False).input_ids)
                spaced = tuple(self.tokenizer(" " + word.lstrip(), add_special_tokens=False).input_ids)
                found += [ids for ids in (plain, spaced if spaced and plain and spaced[0] != plain[0] and
                                          len(spaced) == len(plain) else ()) if ids]
            return tuple(dict.fromkeys(found))

        return await self._run(tokenize)

    async def render_chat(self, conversation: list[dict], options: dict, param: str,
                          tools: list[dict] | None = None, bounded: bool = True) -> str:
        """The conversation rendered by the chat template (the prompt's text: `encode` it with add_special_tokens
        false); `options`: apply_chat_template's keyword arguments (add_generation_prompt, continue_final_message,
        the request's chat_template_kwargs); `bounded` as `encode`'s."""
        documents = options.get("documents") or ()
        reads = self.rendering_variables[tools is not None]
        if documents and reads is not None and "documents" not in reads:
            raise APIError(400, "this model's chat template does not render documents", "documents", "invalid_value")
        if bounded:
            self.check_length(sum(len(m["content"]) for m in conversation) +
                              sum(len(k) + len(v) for d in documents for k, v in d.items()), param)
        return await self._run(lambda: self._render(conversation, options, tools))

    async def decode(self, ids: list[int]) -> str:
        return await self._run(lambda: self.tokenizer.decode(ids))

    async def run(self, work):
        """Other work that decodes much (a scored prompt's answer: each token's text), on the tokenizer's thread."""
        return await self._run(work)

    async def grammar(self, kind: str, value, param: str) -> str:
        """The llguidance grammar of a structured output (app/engine/structured.py), checked against this model's
        tokenizer here, so that a schema, regex or grammar it cannot use is a 400 naming `param`."""
        return await self._run(lambda: self._grammar(kind, value, param))

    def _grammar(self, kind: str, value, param: str) -> str:
        """The grammar, checked: it compiles, and its first tokens are followed here as the engine would (quickly,
        allowing some token), so that a grammar that fails or stalls the engine only there is a 400 too.
        Grammars checked are remembered, good or wrong (a client sends the same schema every turn; a wrong one again
        is refused at once); one refused as too slow is tried again."""
        from app.engine.structured import GrammarBusy, SlowGrammar, check_grammar, first_mask_problem, grammar_for

        what = {"json": "JSON schema", "json_object": "JSON object"}.get(kind, kind)
        try:
            grammar = grammar_for(kind, value)
            if grammar in self._checked:
                self._checked.move_to_end(grammar)
                error = self._checked[grammar]
            else:
                tokenizer = self._grammar_tokenizer_built()
                error = check_grammar(grammar, tokenizer) or first_mask_problem(grammar, tokenizer)
                if not isinstance(error, SlowGrammar):  # (too slow may be a busy moment's: tried again next time)
                    self._checked[grammar] = error
                while len(self._checked) > self.CHECKED:
                    self._checked.popitem(last=False)
        except GrammarBusy as exc:
            raise APIError(503, f"{param}: {exc}", param, "server_busy") from None
        except Exception as exc:  # noqa: BLE001 (whatever the library says of this input is the client's 400)
            error = str(exc) or type(exc).__name__
        if error is not None:
            raise APIError(400, f"{param}: this {what} cannot constrain the output: {error}", param, "invalid_value")
        return grammar

    def check_length(self, chars: int, param: str) -> None:
        if chars > self.max_text_chars:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"your text has {chars} characters, more than {self.max_text_chars} (so more than "
                                f"{self.max_model_len} tokens in any tokenization). Please reduce the text.", param,
                           "context_length_exceeded")

    def _render(self, conversation: list[dict], options: dict, tools: list[dict] | None) -> str:
        if self.template_variables is not None:  # what the template never reads is not copied into it (as vLLM)
            options = {key: value for key, value in options.items()
                       if key in self.template_variables or key in ("add_generation_prompt", "continue_final_message")}
        try:
            return self.tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False,
                                                      chat_template=self.chat_template, **options)
        except Exception as exc:  # the template refused this conversation (roles, order, ...)
            raise APIError(400, f"the chat template cannot render these messages: {exc}", "messages") from None

    async def _run(self, work):
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)


def tool_format(template: str | dict | None, knows_tools: bool) -> str | None:
    """How a model with this chat template writes tool calls (app/server/tools.py): "array" where the template
    renders no tools (this server's own shape), "hermes" where it asks for JSON in `<tool_call>` tags (Qwen 2.5 and
    3, Hermes), "llama3_json" where it asks for one `{"name": ..., "parameters": ...}` object (Llama 3.1 to 3.3),
    "mistral" where it writes calls after `[TOOL_CALLS]` as a JSON array (Mistral 7B v0.3, Nemo, Small 3),
    "mistral_args" where it writes each as `[TOOL_CALLS]name[ARGS]{...}` (Devstral, Magistral, Mistral Small 3.2),
    "qwen3_xml" where it puts XML in the tags (`<function=...>` and `<parameter=...>`: Qwen3-Coder, Qwen3.5), None
    for a format this server cannot read: other templates that render tools (GLM's `<arg_key>` in the tags, ...)."""
    if not knows_tools:
        return "array"
    texts = template.values() if isinstance(template, dict) else [template or ""]
    if any("<tool_call>" in text and "<function=" not in text and "<arg_key>" not in text for text in texts):
        return "hermes"
    if any("<tool_call>" in text and "<function=" in text and "<parameter=" in text for text in texts):
        return "qwen3_xml"
    if any(LLAMA3_JSON in text for text in texts):
        return "llama3_json"
    if any(MISTRAL_TAG in text and ARGS_TAG in text for text in texts):  # Mistral's later format
        return "mistral_args"
    if any(MISTRAL_TAG in text for text in texts):
        return "mistral"
    return None


# how Llama 3.1, 3.2 and 3.3's templates tell the model its calls' shape
LLAMA3_JSON = '"parameters": dictionary of argument name and its value'


def template_variables(template: str | dict | None) -> set[str] | None:
    """The variables a chat template (or any of a tokenizer's named ones) reads; None where Jinja cannot parse it
    here (a tag only transformers' environment knows)."""
    from jinja2 import Environment, TemplateSyntaxError, meta

    found: set[str] = set()
    for text in (template.values() if isinstance(template, dict) else [template or ""]):
        try:
            found |= meta.find_undeclared_variables(Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text))
        except TemplateSyntaxError:
            return None
    return found
