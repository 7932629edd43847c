"""OpenAI requests -> samples, and samples' token events -> OpenAI responses / chunks.

No I/O here: ``prepare_chat`` / ``prepare_completion`` validate a request and build a ``Job``
(prompt ids tokenised once, one ``Sample`` per choice, each with its own request id and seed);
``SampleAssembler`` turns one sample's ``TokenEvent`` stream into ``Piece`` deltas (incremental
detokenisation, stop strings with hold-back, reasoning / DSML tool-call parsing, logprobs);
``chat_*`` / ``completion_*`` shape them as OpenAI JSON. ``server.gateway`` drives it.

Seeds: every sample's ``SamplingParams.seed`` is set (both P/D legs must draw alike). With a
client ``seed`` s, choice i uses ``(s + i) mod 2**64`` (vLLM v1's rule for n > 1), so choice i of
an n-sample request equals a single request with seed s + i. Without one, each sample draws a
random 63-bit seed.

Output text rules (vLLM's): the text of a final stop token (EOS or ``stop_token_ids``) is not
output unless ``include_stop_str_in_output``; a matched stop string ends the sample with
finish_reason "stop" and is cut from the text (kept with ``include_stop_str_in_output``); while
streaming, text that may be the start of a stop string is held back until it cannot be.
"""
from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field

from engine.chat import THINK_START, ChatError, apply_chat_template, prompt_token_ids
from engine.detokenizer import IncrementalDetokenizer
from engine.parsers import OutputParser
from engine.sampling import MAX_LOGPROBS, Sampled, SamplingError, SamplingParams
from server.backend import TokenEvent
from server.protocol import MAX_STOP, MAX_STOP_CHARS, ApiError, ChatCompletionRequest, CompletionRequest

_U64 = 1 << 64
_MIN_LOGPROB = -9999.0          # JSON has no -inf (vLLM clamps the same way)


# ---- request -> samples ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """One choice: ``index`` in the response, ``prompt_index`` into ``Job.prompts``."""

    index: int
    prompt_index: int
    request_id: str
    params: SamplingParams


@dataclass
class Job:
    """A validated request. ``prompts``: token ids of each distinct prompt (chat: one);
    ``echo``: per prompt, text prepended to each choice (completions ``echo``)."""

    kind: str                      # "chat" | "completion"
    id: str
    created: int
    model: str
    prompts: list[list[int]]
    samples: list[Sample]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    stop: tuple[str, ...]
    include_stop: bool
    skip_special: bool
    logprobs: int | None           # top alternatives per token (None: no logprobs)
    thinking: bool = False         # chat: the prompt ends inside <think>
    tools_enabled: bool = False
    parallel_tool_calls: bool = True
    echo: list[str] = field(default_factory=list)
    return_token_ids: bool = False  # vLLM extra: ids beside the text

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def _sampling_error(e: SamplingError, logprobs_field: str) -> ApiError:
    msg = str(e)
    name = msg.split(":", 1)[0]
    name = {"max_new_tokens": "max_tokens", "logprobs": logprobs_field}.get(name, name)
    return ApiError(name + msg[msg.find(":"):] if ":" in msg else msg, 400, name)


def sample_seed(seed: int | None, i: int) -> int:
    """Seed of choice ``i``: ``(seed + i) mod 2**64``, or a random 63-bit one when ``seed`` is None."""
    return random.getrandbits(63) if seed is None else (seed + i) % _U64


def _common_checks(req, max_n: int) -> None:
    """Checks that do not depend on the prompt; raises ApiError naming the field."""
    if not 1 <= req.n <= max_n:
        raise ApiError(f"n: must be in [1, {max_n}], got {req.n}", 400, "n")
    if req.seed is not None and not -(1 << 63) <= req.seed < _U64:
        raise ApiError(f"seed: must be a 64-bit integer, got {req.seed}", 400, "seed")
    if req.min_tokens < 0:
        raise ApiError(f"min_tokens: must be >= 0, got {req.min_tokens}", 400, "min_tokens")
    if req.min_tokens > 0:
        raise ApiError("min_tokens: not supported by this server (use 0)", 400, "min_tokens")
    if req.stream_options is not None and not req.stream:
        raise ApiError("stream_options: only allowed when stream is true", 400, "stream_options")
    if req.logit_bias:
        for k, v in req.logit_bias.items():
            if not k.lstrip("-").isdigit() or int(k) < 0:
                raise ApiError(f"logit_bias: keys must be token ids, got {k!r}", 400, "logit_bias")
            if not -100 <= v <= 100:
                raise ApiError(f"logit_bias: values must be in [-100, 100], got {v} for {k!r}", 400, "logit_bias")
        raise ApiError("logit_bias: not supported by this server", 400, "logit_bias")
    if isinstance(req.stop, list) and not all(isinstance(s, str) for s in req.stop):
        raise ApiError("stop: must be a string or a list of strings", 400, "stop")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stops) > MAX_STOP:
        raise ApiError(f"stop: at most {MAX_STOP} stop strings, got {len(stops)}", 400, "stop")
    for j, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            f = "stop" if isinstance(req.stop, str) else f"stop[{j}]"
            raise ApiError(f"{f}: at most {MAX_STOP_CHARS} characters, got {len(s)}", 400, "stop")


def _max_tokens(requested: int | None, prompt_len: int, max_model_len: int, prompt_field: str,
                field_name: str) -> int:
    """Tokens to generate: ``requested`` or, when None, up to the context limit (vLLM)."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ApiError(f"{prompt_field}: {prompt_len} tokens leave no room to generate within the model's context "
                       f"length of {max_model_len} tokens", 400, prompt_field)
    if requested is None:
        return room
    if requested < 1:
        raise ApiError(f"{field_name}: must be >= 1, got {requested}", 400, field_name)
    if requested > room:
        raise ApiError(f"{field_name}: this model's maximum context length is {max_model_len} tokens, but "
                       f"{prompt_len + requested} were requested ({prompt_len} in the {prompt_field}, {requested} "
                       f"in the completion); reduce the length of the {prompt_field} or {field_name}", 400, field_name)
    return requested


def _params(req, max_new_tokens: int, logprobs: int | None, logprobs_field: str, seed: int) -> SamplingParams:
    def opt(v, default):
        return default if v is None else v
    try:
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=opt(req.temperature, 1.0), top_p=opt(req.top_p, 1.0),
            top_k=opt(req.top_k, -1), min_p=opt(req.min_p, 0.0), presence_penalty=opt(req.presence_penalty, 0.0),
            frequency_penalty=opt(req.frequency_penalty, 0.0),
            repetition_penalty=opt(req.repetition_penalty, 1.0), seed=seed,
            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, logprobs=logprobs)
    except SamplingError as e:
        raise _sampling_error(e, logprobs_field) from None


def _stops(req) -> tuple[str, ...]:
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    return tuple(s for s in stop if s)


_JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_MAX_SCHEMA_DEPTH = 32
_SUBSCHEMA = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _check_schema(node, f: str, depth: int = 0) -> None:
    """Structural checks of a JSON schema (OpenAI rejects these too); ApiError naming the keyword.

    ``type`` must be a JSON-schema type (or a list of them), the keywords that hold schemas must
    hold objects (or booleans), ``required`` a list of strings; nesting at most 32 deep.
    """
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise ApiError(f"{f}: a JSON schema must be an object, got {type(node).__name__}", 400, f)
    if depth > _MAX_SCHEMA_DEPTH:
        raise ApiError(f"{f}: JSON schema nested deeper than {_MAX_SCHEMA_DEPTH} levels", 400, f)
    t = node.get("type")
    if t is not None:
        ts = t if isinstance(t, list) else [t]
        if not ts or not all(isinstance(x, str) and x in _JSON_TYPES for x in ts):
            raise ApiError(f"{f}.type: must be one of {sorted(_JSON_TYPES)} (or a list of them), got {t!r}", 400,
                           f"{f}.type")
    req = node.get("required")
    if req is not None and not (isinstance(req, list) and all(isinstance(x, str) for x in req)):
        raise ApiError(f"{f}.required: must be a list of property names", 400, f"{f}.required")
    for k in _SUBSCHEMA:
        if k in node:
            sub = node[k]
            if k == "items" and isinstance(sub, list):          # draft-4 tuple form
                for i, x in enumerate(sub):
                    _check_schema(x, f"{f}.{k}[{i}]", depth + 1)
            else:
                _check_schema(sub, f"{f}.{k}", depth + 1)
    for k in _SCHEMA_LISTS:
        if k in node:
            if not isinstance(node[k], list) or not node[k]:
                raise ApiError(f"{f}.{k}: must be a non-empty list of schemas", 400, f"{f}.{k}")
            for i, x in enumerate(node[k]):
                _check_schema(x, f"{f}.{k}[{i}]", depth + 1)
    for k in _SCHEMA_MAPS:
        if k in node:
            if not isinstance(node[k], dict):
                raise ApiError(f"{f}.{k}: must be an object mapping names to schemas", 400, f"{f}.{k}")
            for name, x in node[k].items():
                _check_schema(x, f"{f}.{k}.{name}", depth + 1)


def _too_deep(obj, limit: int) -> bool:
    """Whether ``obj`` (parsed JSON) nests lists / dicts more than ``limit`` deep (iterative)."""
    stack = [(obj, 0)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            if d >= limit:
                return True
            stack.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    return False


def _check_tool(tool, f: str) -> str:
    """Validate one OpenAI tool (``{"type": "function", "function": {...}}``); its function name.

    Raises:
        ApiError: 400 naming the field (``tools[0].function.parameters.type`` ...).
    """
    if not isinstance(tool, dict):
        raise ApiError(f"{f}: must be an object", 400, f)
    if tool.get("type", "function") != "function":
        raise ApiError(f"{f}.type: must be 'function', got {tool.get('type')!r}", 400, f"{f}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ApiError(f"{f}.function: must be an object", 400, f"{f}.function")
    if _too_deep(fn, 2 * _MAX_SCHEMA_DEPTH):
        raise ApiError(f"{f}.function: nested deeper than {2 * _MAX_SCHEMA_DEPTH} levels", 400, f"{f}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(f"{f}.function.name: must be a non-empty string", 400, f"{f}.function.name")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise ApiError(f"{f}.function.description: must be a string", 400, f"{f}.function.description")
    if fn.get("parameters") is not None:
        p, pf = fn["parameters"], f"{f}.function.parameters"
        if not isinstance(p, dict):
            raise ApiError(f"{pf}: must be a JSON schema object, got {type(p).__name__}", 400, pf)
        if p.get("type", "object") != "object":
            raise ApiError(f"{pf}.type: must be 'object' (function parameters are an object), got {p['type']!r}",
                           400, f"{pf}.type")
        _check_schema(p, pf)
    return name


def _tools(req: ChatCompletionRequest) -> tuple[list[dict] | None, bool]:
    """(tools to render, parse tool calls?) from tools / tool_choice; ApiError on a bad tool or choice.

    "none" leaves the tools out of the prompt. "required" and a named function are accepted but
    not enforced (no constrained decoding): the output is parsed as with "auto".
    """
    tc, tools = req.tool_choice, req.tools or None
    names = [_check_tool(t, f"tools[{j}]") for j, t in enumerate(tools or [])]
    if isinstance(tc, dict):
        fn = tc.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tc.get("type", "function") != "function" or not isinstance(name, str):
            raise ApiError("tool_choice: must be 'none', 'auto', 'required' or "
                           "{'type': 'function', 'function': {'name': ...}}", 400, "tool_choice")
        if not tools:
            raise ApiError("tool_choice: a named function requires 'tools'", 400, "tool_choice")
        if name not in names:
            raise ApiError(f"tool_choice: function {name!r} is not in tools ({', '.join(map(str, names))})", 400,
                           "tool_choice")
    elif tc in ("auto", "required") and not tools:
        raise ApiError(f"tool_choice: {tc!r} requires 'tools'", 400, "tool_choice")
    if tc == "none" or not tools:
        return None, False
    return tools, True


def prepare_chat(req: ChatCompletionRequest, tokenizer, model: str, max_model_len: int, max_n: int) -> Job:
    """Validate a chat request, render + tokenise the prompt once, and build its samples.

    Raises:
        ApiError: 400 naming the field (messages[i]..., max_tokens, top_logprobs, tools[i]..., tool_choice, ...).
    """
    _common_checks(req, max_n)
    if req.echo:
        raise ApiError("echo: not supported for chat completions", 400, "echo")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise ApiError("top_logprobs: requires logprobs=true", 400, "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(f"top_logprobs: must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", 400,
                           "top_logprobs")
    rf = req.response_format
    if rf is not None and rf.get("type", "text") != "text":
        raise ApiError(f"response_format: type {rf.get('type')!r} is not supported (no structured output); "
                       f"use 'text'", 400, "response_format")
    kw = req.chat_template_kwargs or {}
    thinking = kw.get("thinking", kw.get("enable_thinking"))
    effort = kw.get("reasoning_effort", req.reasoning_effort)
    tools, tools_enabled = _tools(req)
    try:
        text = apply_chat_template(req.messages, tools=tools, thinking=thinking, reasoning_effort=effort,
                                   drop_thinking=kw.get("drop_thinking", True),
                                   add_generation_prompt=req.add_generation_prompt)
    except ChatError as e:
        msg = str(e)
        field_name = msg.split(":", 1)[0]
        key = "enable_thinking" if field_name == "thinking" and "thinking" not in kw else field_name
        if key in kw:          # an option that came from chat_template_kwargs
            field_name = f"chat_template_kwargs.{key}"
            msg = field_name + msg[msg.find(":"):]
        raise ApiError(msg, 400, field_name) from None
    _fits_context(text, tokenizer, max_model_len, "messages")
    ids = prompt_token_ids(tokenizer, text)
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_new = _max_tokens(req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
                          len(ids), max_model_len, "messages", name)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    base = f"chatcmpl-{uuid.uuid4().hex}"
    samples = [Sample(i, 0, f"{base}-{i}", _params(req, max_new, logprobs, "top_logprobs", sample_seed(req.seed, i)))
               for i in range(req.n)]
    so = req.stream_options
    return Job("chat", base, int(time.time()), model, [ids], samples, req.stream, bool(so and so.include_usage),
               bool(so and so.continuous_usage_stats), _stops(req), req.include_stop_str_in_output,
               req.skip_special_tokens, logprobs, thinking=text.endswith(THINK_START), tools_enabled=tools_enabled,
               parallel_tool_calls=req.parallel_tool_calls is not False, return_token_ids=req.return_token_ids)


def _fits_context(text: str, tokenizer, max_model_len: int, field: str) -> None:
    """A text that cannot fit the context whatever its tokens is refused before tokenising it
    (tokenising holds the GIL: a 30 MB prompt would stall the gateway for seconds). Raises ApiError."""
    limit = max_model_len * tokenizer.max_token_chars
    if len(text) > limit:
        raise ApiError(f"{field}: {len(text)} characters cannot fit the context of {max_model_len} tokens "
                       f"(a token covers at most {tokenizer.max_token_chars} characters)", 400, field)


def _completion_prompts(req: CompletionRequest, tokenizer, max_model_len: int) -> list[tuple[list[int], str]]:
    """[(ids, echo text)] per prompt; ApiError naming ``prompt`` for empty / out-of-vocab prompts."""
    p = req.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
        p = [p]
    if not p:
        raise ApiError("prompt: must not be empty", 400, "prompt")
    out, vocab = [], tokenizer.vocab_size
    for j, x in enumerate(p):
        f = "prompt" if len(p) == 1 else f"prompt[{j}]"
        if isinstance(x, str):
            _fits_context(x, tokenizer, max_model_len, f)
            ids = tokenizer.encode(x, add_bos=req.add_special_tokens)
            echo = x
        else:
            if x and not (0 <= min(x) and max(x) < vocab):
                bad = next(t for t in x if not 0 <= t < vocab)
                raise ApiError(f"{f}: token id {bad} is not in [0, {vocab})", 400, "prompt")
            # the prompt's text only when it is echoed (detokenising 100k ids takes ~60 ms of TTFT)
            ids = list(x)
            echo = tokenizer.decode(x, skip_special_tokens=req.skip_special_tokens) if req.echo else ""
        if not ids:
            raise ApiError(f"{f}: must contain at least one token", 400, "prompt")
        out.append((ids, echo))
    return out


def prepare_completion(req: CompletionRequest, tokenizer, model: str, max_model_len: int, max_n: int) -> Job:
    """Validate a completions request, tokenise each prompt once, and build its samples
    (choice index = prompt index * n + i, as vLLM). Raises ApiError (400 naming the field)."""
    _common_checks(req, max_n)
    if req.suffix is not None:
        raise ApiError("suffix: not supported by this server", 400, "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError("best_of: not supported (only best_of == n)", 400, "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise ApiError(f"logprobs: must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", 400, "logprobs")
    if req.echo and req.logprobs is not None:
        raise ApiError("echo: not supported together with logprobs (no prompt logprobs)", 400, "echo")
    prompts = _completion_prompts(req, tokenizer, max_model_len)
    if len(prompts) * req.n > max_n:
        raise ApiError(f"n: {len(prompts)} prompts x n={req.n} exceeds {max_n} choices", 400, "n")
    base = f"cmpl-{uuid.uuid4().hex}"
    samples = []
    for j, (ids, _) in enumerate(prompts):
        max_new = _max_tokens(req.max_tokens, len(ids), max_model_len, "prompt", "max_tokens")
        for i in range(req.n):
            k = j * req.n + i
            samples.append(Sample(k, j, f"{base}-{k}",
                                  _params(req, max_new, req.logprobs, "logprobs", sample_seed(req.seed, i))))
    so = req.stream_options
    return Job("completion", base, int(time.time()), model, [ids for ids, _ in prompts], samples, req.stream,
               bool(so and so.include_usage), bool(so and so.continuous_usage_stats), _stops(req),
               req.include_stop_str_in_output, req.skip_special_tokens, req.logprobs,
               echo=[e for _, e in prompts] if req.echo else [], return_token_ids=req.return_token_ids)


# ---- one sample's events -> deltas -----------------------------------------------------------------
class TokenStrings:
    """Token id -> its text alone (for logprobs), cached."""

    def __init__(self, tokenizer, max_entries: int = 1 << 16):
        self._tok, self._cache, self._max = tokenizer, {}, max_entries

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._tok.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < self._max:
                self._cache[token_id] = s
        return s


@dataclass
class Piece:
    """What one event of one sample adds. ``text``: completions text / chat content;
    ``logprobs``: chat: list of content entries, completions: dict of four lists (None: not asked);
    ``finish_reason`` set on the last piece; ``num_tokens`` new tokens, ``total_tokens`` so far."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list | dict | None = None
    finish_reason: str | None = None
    num_tokens: int = 0
    total_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)   # the new tokens counted in num_tokens


def _lp(x: float | None) -> float:
    return _MIN_LOGPROB if x is None else max(x, _MIN_LOGPROB)


class SampleAssembler:
    """One sample's token events -> ``Piece`` deltas (see the module docstring for the rules).

    ``finished`` turns True on the piece carrying ``finish_reason``; ``stopped_by_string`` means
    the gateway must close the backend iterator (aborting the sample).
    """

    def __init__(self, job: Job, sample: Sample, tokenizer, token_strings: TokenStrings):
        self.job = job
        self._detok = IncrementalDetokenizer(tokenizer, job.prompts[sample.prompt_index], job.skip_special)
        self._parser = OutputParser(job.thinking, job.tools_enabled) if job.kind == "chat" else None
        self._strs = token_strings
        self._stops = job.stop
        self._text = ""          # generated text (cut at a stop string), before parsing
        self._sent = 0           # chars of _text passed on
        self._checked = 0        # chars of _text searched for stop strings
        self._offset = len(job.echo[sample.prompt_index]) if job.echo else 0   # completions text_offset
        self.num_tokens = 0
        self.num_tool_calls = 0
        self.finish_reason: str | None = None
        self.stopped_by_string = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, ev: TokenEvent) -> Piece:
        """Consume one event; returns the text that is now certain (possibly empty)."""
        if self.finished:
            return Piece(total_tokens=self.num_tokens)
        used: list[Sampled] = []
        ids: list[int] = []
        n0, last = self.num_tokens, len(ev.token_ids) - 1
        for k, tid in enumerate(ev.token_ids):
            self.num_tokens += 1
            ids.append(tid)
            if ev.logprobs is not None and k < len(ev.logprobs):
                used.append(ev.logprobs[k])
            stop_token = ev.finished and k == last and ev.finish_reason == "stop"
            if not stop_token or self.job.include_stop:
                self._text += self._detok.push(tid)
            if self._match_stop():
                self.finish_reason, self.stopped_by_string = "stop", True
                break
        if ev.finished and not self.finished:
            self._text += self._detok.flush()
            self.stopped_by_string = self._match_stop()
            self.finish_reason = "stop" if self.stopped_by_string else (ev.finish_reason or "stop")
        p = self._piece(used, self.num_tokens - n0)
        p.token_ids = ids
        return p

    def abort(self, reason: str = "abort") -> Piece:
        """End without a final event (backend stream ended early); flushes what is held back."""
        if self.finished:
            return Piece(total_tokens=self.num_tokens)
        self._text += self._detok.flush()
        self._match_stop()
        self.finish_reason = reason
        return self._piece([], 0)

    def _match_stop(self) -> bool:
        """Cut ``_text`` at the earliest stop string found in the unchecked part; True if one was."""
        if not self._stops:
            return False
        start = max(0, self._checked - max(map(len, self._stops)) + 1)
        best = None
        for s in self._stops:
            i = self._text.find(s, start)
            if i != -1 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
                best = (i, s)
        self._checked = len(self._text)
        if best is None:
            return False
        i, s = best
        self._text = self._text[:i + (len(s) if self.job.include_stop else 0)]
        self._checked = len(self._text)
        return True

    def _safe_end(self) -> int:
        """End of the text that cannot be the start of a stop string."""
        t = self._text
        for start in range(max(self._sent, len(t) - max(map(len, self._stops), default=0) + 1), len(t)):
            tail = t[start:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self._stops):
                return start
        return len(t)

    def _piece(self, used: list[Sampled], new_tokens: int) -> Piece:
        end = len(self._text) if self.finished else self._safe_end()
        text, self._sent = self._text[self._sent:end], max(self._sent, end)
        p = Piece(num_tokens=new_tokens, total_tokens=self.num_tokens, finish_reason=None)
        if self._parser is not None:
            d = self._parser.feed(text)
            if self.finished:
                d = d + self._parser.finish()
            calls = d.tool_calls
            if not self.job.parallel_tool_calls:
                calls = calls[:max(0, 1 - self.num_tool_calls)]
            p.text, p.reasoning = d.content, d.reasoning_content
            p.tool_calls = [{**c, "index": self.num_tool_calls + j} for j, c in enumerate(calls)]
            self.num_tool_calls += len(calls)
        else:
            p.text = text
        if self.job.logprobs is not None and used:
            p.logprobs = self._chat_logprobs(used) if self.job.kind == "chat" else self._completion_logprobs(used)
        if self.finished:
            reason = self.finish_reason
            p.finish_reason = "tool_calls" if reason == "stop" and self.num_tool_calls else reason
        return p

    def _entry(self, token_id: int, logprob: float | None) -> dict:
        s = self._strs(token_id)
        return {"token": s, "logprob": _lp(logprob), "bytes": list(s.encode("utf-8"))}

    def _chat_logprobs(self, used: list[Sampled]) -> list[dict]:
        return [{**self._entry(x.token_id, x.logprob),
                 "top_logprobs": [self._entry(t, lp) for t, lp in (x.top_logprobs or [])]} for x in used]

    def _completion_logprobs(self, used: list[Sampled]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for x in used:
            s = self._strs(x.token_id)
            top = {self._strs(t): _lp(lp) for t, lp in (x.top_logprobs or [])}
            if self.job.logprobs:
                top.setdefault(s, _lp(x.logprob))        # the chosen token is always listed (vLLM)
            out["tokens"].append(s)
            out["token_logprobs"].append(_lp(x.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._offset)
            self._offset += len(s)
        return out


# ---- response shapes -------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class ChoiceResult:
    """A whole choice for a non-streamed response (the sum of its pieces)."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list | dict | None = None
    finish_reason: str | None = None
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)

    def add(self, p: Piece) -> None:
        self.text += p.text
        self.token_ids += p.token_ids
        self.reasoning += p.reasoning
        self.tool_calls += p.tool_calls
        self.num_tokens = p.total_tokens
        self.finish_reason = p.finish_reason or self.finish_reason
        if p.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = p.logprobs
            elif isinstance(p.logprobs, list):
                self.logprobs = self.logprobs + p.logprobs
            else:
                self.logprobs = {k: self.logprobs[k] + p.logprobs[k] for k in self.logprobs}


def _tool_call(c: dict, stream: bool) -> dict:
    out = {"id": c["id"], "type": "function", "function": dict(c["function"])}
    return {"index": c["index"], **out} if stream else out


def _head(job: Job, obj: str) -> dict:
    return {"id": job.id, "object": obj, "created": job.created, "model": job.model}


def full_response(job: Job, choices: list[ChoiceResult]) -> dict:
    """The non-streamed response body (chat.completion or text_completion)."""
    out = []
    for i, c in enumerate(choices):
        if job.logprobs is not None and c.logprobs is None:       # no tokens: empty logprobs
            c.logprobs = [] if job.kind == "chat" else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                        "text_offset": []}
        if job.kind == "chat":
            msg = {"role": "assistant", "content": c.text if c.text or not c.tool_calls else None,
                   "reasoning_content": c.reasoning if job.thinking else None}
            if c.tool_calls:
                msg["tool_calls"] = [_tool_call(t, False) for t in c.tool_calls]
            lp = {"content": c.logprobs} if c.logprobs is not None else None
            out.append({"index": i, "message": msg, "logprobs": lp, "finish_reason": c.finish_reason})
        else:
            echo = job.echo[job.samples[i].prompt_index] if job.echo else ""
            out.append({"index": i, "text": echo + c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason})
        if job.return_token_ids:
            out[-1].update(token_ids=c.token_ids, prompt_token_ids=job.prompts[job.samples[i].prompt_index])
    body = _head(job, "chat.completion" if job.kind == "chat" else "text_completion")
    body.update(choices=out, usage=usage(job.prompt_tokens, sum(c.num_tokens for c in choices)))
    return body


def _chunk(job: Job, choice: dict, usage_: dict | None = None) -> dict:
    body = _head(job, "chat.completion.chunk" if job.kind == "chat" else "text_completion")
    body["choices"] = [choice]
    if job.include_usage:
        body["usage"] = usage_
    return body


def first_chunks(job: Job) -> list[dict]:
    """Chunks sent before any token: chat: role "assistant" per choice; completions: the echo."""
    if job.kind == "chat":
        out = [_chunk(job, {"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}) for s in job.samples]
        if job.return_token_ids:
            for c in out:
                c["prompt_token_ids"] = job.prompts[0]
        return out
    if job.echo:
        return [_chunk(job, {"index": s.index, "text": job.echo[s.prompt_index], "logprobs": None,
                             "finish_reason": None}) for s in job.samples]
    return []


def piece_chunk(job: Job, sample: Sample, p: Piece) -> dict | None:
    """The chunk for one piece, or None when it carries nothing."""
    if not (p.text or p.reasoning or p.tool_calls or p.finish_reason or p.logprobs
            or (job.return_token_ids and p.token_ids)):
        return None
    u = None
    if job.continuous_usage:
        u = usage(len(job.prompts[sample.prompt_index]), p.total_tokens)
    if job.kind == "chat":
        delta: dict = {}
        if p.text:
            delta["content"] = p.text
        if p.reasoning:
            delta["reasoning_content"] = p.reasoning
        if p.tool_calls:
            delta["tool_calls"] = [_tool_call(t, True) for t in p.tool_calls]
        lp = {"content": p.logprobs} if p.logprobs is not None else None
        choice = {"index": sample.index, "delta": delta, "logprobs": lp, "finish_reason": p.finish_reason}
    else:
        choice = {"index": sample.index, "text": p.text, "logprobs": p.logprobs, "finish_reason": p.finish_reason}
    if job.return_token_ids:
        choice["token_ids"] = p.token_ids
    return _chunk(job, choice, u)


def usage_chunk(job: Job, completion_tokens: int) -> dict:
    """The final ``include_usage`` chunk: empty choices, the request's usage."""
    body = _head(job, "chat.completion.chunk" if job.kind == "chat" else "text_completion")
    body.update(choices=[], usage=usage(job.prompt_tokens, completion_tokens))
    return body
