"""POST /v1/completions: raw prompts (text or token ids) in, plain text out. No chat format here.

A text prompt is encoded as given, special-token spellings included (a completions prompt is the
raw model input, as in vLLM); BOS is prepended unless ``add_special_tokens`` is false. Output text
rules (vLLM's): the text of a final stop token (EOS or ``stop_token_ids``) is not output unless
``include_stop_str_in_output``; a matched stop string ends the sample with finish_reason "stop" and
is cut from the text (kept with ``include_stop_str_in_output``); while streaming, text that may be
the start of a stop string is held back until it cannot be.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.core.sampling_params import MAX_LOGPROBS, Sampled
from server.backends.base import TokenEvent
from server.gateway.jobs import (Job, Piece, Sample, check_common, check_stops, refuse_not_done, sample_seed,
                                 sampling_params, sse, usage)
from server.gateway.protocol import ApiError, CompletionRequest, error_body

_MIN_LOGPROB = -9999.0          # JSON has no -inf (vLLM clamps the same way)


def lp(x: float | None) -> float:
    return _MIN_LOGPROB if x is None else max(x, _MIN_LOGPROB)


def max_new_tokens(requested: int | None, prompt_len: int, max_model_len: int, prompt_field: str,
                   field_name: str) -> int:
    """Tokens to generate: ``requested`` or, when None, up to the context limit (vLLM). Raises ApiError."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ApiError(f"{prompt_field}: {prompt_len} tokens leave no room to generate within the model's context "
                       f"length of {max_model_len} tokens", 400, prompt_field)
    if requested is None:
        return room
    if requested > room:
        raise ApiError(f"{field_name}: this model's maximum context length is {max_model_len} tokens, but "
                       f"{prompt_len + requested} were requested ({prompt_len} in the {prompt_field}, {requested} "
                       f"in the completion); reduce the length of the {prompt_field} or {field_name}", 400, field_name)
    return requested


def fits_context(text: str, tokenizer, max_model_len: int, field: str) -> None:
    """A text that cannot fit the context whatever its tokens is refused before tokenising it
    (tokenising holds the GIL: a 30 MB prompt would stall the gateway for seconds). Raises ApiError."""
    limit = max_model_len * tokenizer.max_token_chars
    if len(text) > limit:
        raise ApiError(f"{field}: {len(text)} characters cannot fit the context of {max_model_len} tokens "
                       f"(a token covers at most {tokenizer.max_token_chars} characters)", 400, field)


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


def _prompts(req: CompletionRequest, tokenizer, max_model_len: int) -> list[tuple[list[int], str]]:
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
            fits_context(x, tokenizer, max_model_len, f)
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


def prepare_completion(req: CompletionRequest, tokenizer, strings: TokenStrings, model: str, max_model_len: int,
                       max_n: int) -> CompletionJob:
    """Validate a completions request, tokenise each prompt once, and build its samples
    (choice index = prompt index * n + i, as vLLM). Raises ApiError (400 naming the field)."""
    check_common(req, max_n)
    refuse_not_done(req.model_dump(), {"response_format": (None, {"type": "text"})})
    if req.suffix is not None:
        raise ApiError("suffix: not supported by this server", 400, "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError("best_of: not supported (only best_of == n)", 400, "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise ApiError(f"logprobs: must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", 400, "logprobs")
    if req.echo and req.logprobs is not None:
        raise ApiError("echo: not supported together with logprobs (no prompt logprobs)", 400, "echo")
    prompts = _prompts(req, tokenizer, max_model_len)
    if len(prompts) * req.n > max_n:
        raise ApiError(f"n: {len(prompts)} prompts x n={req.n} exceeds {max_n} choices", 400, "n")
    field_name, requested = "max_tokens", req.max_tokens
    if req.max_completion_tokens is not None:
        field_name, requested = "max_completion_tokens", req.max_completion_tokens
    base = f"cmpl-{uuid.uuid4().hex}"
    fields = req.model_dump()
    samples = []
    for j, (ids, _) in enumerate(prompts):
        max_new = max_new_tokens(requested, len(ids), max_model_len, "prompt", field_name)
        for i in range(req.n):
            k = j * req.n + i
            samples.append(Sample(k, j, f"{base}-{k}", sampling_params(fields, max_new, req.logprobs,
                                                                          sample_seed(req.seed, i))))
    so = req.stream_options
    return CompletionJob(base, int(time.time()), model, [ids for ids, _ in prompts], samples, req.stream,
                         include_usage=bool(so and so.include_usage),
                         continuous_usage=bool(so and so.include_usage and so.continuous_usage_stats),
                         return_token_ids=req.return_token_ids, stop=check_stops(req.stop, "stop"),
                         include_stop=req.include_stop_str_in_output, skip_special=req.skip_special_tokens,
                         logprobs=req.logprobs, echo=[e for _, e in prompts] if req.echo else [],
                         tokenizer=tokenizer, strings=strings)


class CompletionAssembler:
    """One sample's token events -> text pieces (incremental detokenisation, stop strings with
    hold-back, logprobs); keeps the whole choice for a non-streamed response."""

    def __init__(self, job: CompletionJob, sample: Sample):
        self.job = job
        self._detok = IncrementalDetokenizer(job.tokenizer, job.prompts[sample.prompt_index], job.skip_special)
        self._stops = job.stop
        self._text = ""          # generated text (cut at a stop string)
        self._sent = 0           # chars of _text passed on
        self._checked = 0        # chars of _text searched for stop strings
        self._offset = len(job.echo[sample.prompt_index]) if job.echo else 0   # logprobs text_offset
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stopped_by_string = False
        self.result = Piece(logprobs=_empty_logprobs() if job.logprobs is not None else None)

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
        return self._piece(used, self.num_tokens - n0, ids)

    def abort(self, reason: str = "abort") -> Piece:
        """End without a final event (backend stream ended early); flushes what is held back."""
        if self.finished:
            return Piece(total_tokens=self.num_tokens)
        self._text += self._detok.flush()
        self._match_stop()
        self.finish_reason = reason
        return self._piece([], 0, [])

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

    def _piece(self, used: list[Sampled], new_tokens: int, ids: list[int]) -> Piece:
        end = len(self._text) if self.finished else self._safe_end()
        text, self._sent = self._text[self._sent:end], max(self._sent, end)
        p = Piece(text=text, num_tokens=new_tokens, total_tokens=self.num_tokens, finish_reason=self.finish_reason,
                  token_ids=ids)
        if self.job.logprobs is not None and used:
            p.logprobs = self._logprobs(used)
        if not self.job.stream:
            r = self.result
            r.text += p.text
            r.token_ids += ids
            r.total_tokens, r.finish_reason = self.num_tokens, self.finish_reason
            if p.logprobs is not None:
                r.logprobs = {k: r.logprobs[k] + p.logprobs[k] for k in r.logprobs}
        return p

    def _logprobs(self, used: list[Sampled]) -> dict:
        strs = self.job.strings
        out = _empty_logprobs()
        for x in used:
            s = strs(x.token_id)
            top = {strs(t): lp(v) for t, v in (x.top_logprobs or [])}
            if self.job.logprobs:
                top.setdefault(s, lp(x.logprob))        # the chosen token is always listed (vLLM)
            out["tokens"].append(s)
            out["token_logprobs"].append(lp(x.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._offset)
            self._offset += len(s)
        return out


def _empty_logprobs() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


@dataclass
class CompletionJob(Job):
    """A completions request: stop strings, echo, logprobs as OpenAI's legacy completions shape."""

    stop: tuple[str, ...] = ()
    include_stop: bool = False
    skip_special: bool = True
    logprobs: int | None = None       # top alternatives per token (None: no logprobs)
    echo: list[str] = field(default_factory=list)     # per prompt, text prepended to each choice
    tokenizer: object = None
    strings: TokenStrings | None = None

    kind = "completion"

    def assembler(self, sample: Sample) -> CompletionAssembler:
        return CompletionAssembler(self, sample)

    def _chunk(self, choice: dict, usage_: dict | None = None) -> dict:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice]}
        if self.include_usage:
            body["usage"] = usage_
        return body

    def head(self) -> list[str]:
        if not self.echo:
            return []
        return [sse(self._chunk({"index": s.index, "text": self.echo[s.prompt_index], "logprobs": None,
                                 "finish_reason": None})) for s in self.samples]

    def events(self, sample: Sample, p: Piece) -> list[str]:
        if not (p.text or p.finish_reason or p.logprobs or (self.return_token_ids and p.token_ids)):
            return []
        u = usage(len(self.prompts[sample.prompt_index]), p.total_tokens, None,
                  self.cached.get(sample.prompt_index, 0)) if self.continuous_usage else None
        choice = {"index": sample.index, "text": p.text, "logprobs": p.logprobs, "finish_reason": p.finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = p.token_ids
        return [sse(self._chunk(choice, u))]

    def tail(self, asms) -> list[str]:
        out = []
        if self.include_usage:
            out.append(sse({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                            "choices": [], "usage": usage(self.prompt_tokens, sum(a.num_tokens for a in asms.values()),
                                                          None, self.cached_tokens)}))
        return out + ["data: [DONE]\n\n"]

    def error_events(self, status: int, message: str, param: str | None = None) -> list[str]:
        return [sse(error_body(message, status, param)), "data: [DONE]\n\n"]

    def body(self, asms) -> dict:
        choices = []
        for s in self.samples:
            r = asms[s.index].result
            c = {"index": s.index, "text": (self.echo[s.prompt_index] if self.echo else "") + r.text,
                 "logprobs": r.logprobs, "finish_reason": r.finish_reason}
            if self.return_token_ids:
                c.update(token_ids=r.token_ids, prompt_token_ids=self.prompts[s.prompt_index])
            choices.append(c)
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices,
                "usage": usage(self.prompt_tokens, sum(asms[s.index].num_tokens for s in self.samples), None,
                               self.cached_tokens)}
