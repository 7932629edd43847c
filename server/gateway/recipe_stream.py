"""One sample's output token ids -> the recipe's chunks / events (chat, Responses, Messages).

Each sample has its own ``deepseek_recipe.StreamProcessor``: it decodes the ids, splits reasoning
from content at ``</think>``, parses DSML tool calls into JSON arguments, applies stop sequences
to content only (never to reasoning or a tool-call block) and shapes the API's chunks. Around it,
vLLM's token rules:

* the final stop token (EOS or one of ``stop_token_ids``) is counted but its text is not output,
  unless ``include_stop_str_in_output``; with ``skip_special_tokens`` (the default) BOS / EOS met
  mid-output (``ignore_eos``) are counted without text too. A counted token without text goes in as
  ``InferenceChunk.text("", 1)``, so the recipe's token counts equal the engine's;
* an output cut inside a multi-byte character (max_tokens): the processor drops the bytes of the
  unfinished character (as vLLM) and would not count their tokens; they are counted (pushed as
  text-less tokens);
* reasoning tokens are counted from the ids (vLLM's way): the output tokens before ``</think>``
  in thinking mode, BOS / EOS / the final stop token excepted. The recipe counts them by
  re-encoding the reasoning text, which can differ from the tokens generated (and exceed them);
* a stop sequence the recipe matched ends the sample (finish "stop"; the gateway then aborts the
  backend stream); with ``include_stop_str_in_output`` the matched string is appended to the content
  (``stop_suffix``: the stop string the last token completed, as the recipe picks it; it travels
  as the stopping piece's ``text``).
"""
from __future__ import annotations

import deepseek_recipe as dr

from engine.core.sampling_params import Sampled
from server.backends.base import TokenEvent
from server.gateway.dsformat import finish_reason
from server.gateway.jobs import Piece


def _lps(x: Sampled | None):
    if x is None:
        return None
    return [(x.logprob if x.logprob is not None else -9999.0,
             [(t, v if v is not None else -9999.0) for t, v in (x.top_logprobs or [])])]


class RecipeAssembler:
    """Feeds one sample's ``TokenEvent`` s to its stream processor.

    Args:
        processor: a fresh ``deepseek_recipe.StreamProcessor`` for this sample.
        prompt_tokens: the prompt's token count (the recipe reports it in usage).
        accumulate: a recipe response object (``ChatCompletionResponse`` / ``ResponsesResponse`` /
            ``MessagesResponse``) that collects every chunk for a non-streamed response; None when
            streaming (the chunks then travel in the pieces).
        special_ids: BOS and EOS: never reasoning tokens; their text is dropped with ``skip_special``
            (``skip_special_tokens``, the default).
        include_stop: output the text of a final stop token / a matched stop string.
        stops: the request's stop strings (for ``stop_suffix``).
        reasoning_from_start: the output begins inside the reasoning; think_end_id: ``</think>``.
        decode: ids -> text (the tokenizer's ``decode``), for ``stop_suffix`` and a cut character.
    """

    def __init__(self, processor: dr.StreamProcessor, prompt_tokens: int, accumulate=None,
                 special_ids: frozenset[int] = frozenset(), include_stop: bool = False,
                 stops: tuple[str, ...] = (), decode=None, reasoning_from_start: bool = False,
                 think_end_id: int | None = None, skip_special: bool = True):
        self._proc = processor
        self._in_reasoning, self._think_end = reasoning_from_start, think_end_id
        self.reasoning_tokens = 0
        self._acc = accumulate
        self._special, self._skip = special_ids, skip_special
        self._include_stop = include_stop
        self._stops, self._decode = stops, decode
        self._ids: list[int] = []           # ids whose text the processor saw
        self.token_ids: list[int] = []      # every output id (return_token_ids)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stopped_by_string = False
        self.stop_suffix = ""
        self._prompt_tokens, self._started = prompt_tokens, False

    def _start(self, cached_tokens: int) -> list:
        """The recipe's ``ready`` chunk, once, at the first event (which says how many prompt
        tokens the prefix cache served: the recipe reports them in usage)."""
        if self._started:
            return []
        self._started = True
        return self._out(self._proc.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(
            prompt_tokens=self._prompt_tokens, prompt_cache_hit_tokens=cached_tokens))))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def response(self):
        """The recipe response object that accumulated every chunk (non-streamed), or None."""
        return self._acc

    def _out(self, chunks: list) -> list:
        if self._acc is None:
            return chunks
        for c in chunks:
            self._acc.accumulate(c)
        return []

    def feed(self, ev: TokenEvent) -> Piece:
        """Consume one event; the chunks it produced (streaming) in a piece."""
        if self.finished:
            return Piece(total_tokens=self.num_tokens)
        out = self._start(ev.num_cached_tokens)
        ids: list[int] = []
        n0, last = self.num_tokens, len(ev.token_ids) - 1
        proc = self._proc
        for k, tid in enumerate(ev.token_ids):
            self.num_tokens += 1
            ids.append(tid)
            self.token_ids.append(tid)
            stop_token = ev.finished and k == last and ev.finish_reason == "stop"
            if self._in_reasoning:
                if tid == self._think_end:
                    self._in_reasoning = False
                elif not stop_token and tid not in self._special:
                    self.reasoning_tokens += 1
            if (stop_token and not self._include_stop) or (self._skip and tid in self._special):
                chunk = dr.InferenceChunk.text("", 1)
            else:
                self._ids.append(tid)
                lp = _lps(ev.logprobs[k]) if ev.logprobs is not None and k < len(ev.logprobs) else None
                chunk = dr.InferenceChunk.tokens([tid], lp)
            out += self._out(proc.push(chunk))
            if proc.finished:                     # a stop sequence matched: the recipe ended the output
                self.finish_reason, self.stopped_by_string = "stop", True
                self._set_stop_suffix()
                break
        if ev.finished and not self.finished:
            out += self._end(ev.finish_reason or "stop")
        return Piece(text=self.stop_suffix, chunks=out, num_tokens=self.num_tokens - n0,
                     total_tokens=self.num_tokens, finish_reason=self.finish_reason, token_ids=ids,
                     reasoning_tokens=self.reasoning_tokens)

    def abort(self, reason: str = "abort") -> Piece:
        """End without a final event (the backend stream ended early)."""
        if self.finished:
            return Piece(total_tokens=self.num_tokens)
        out = self._start(0)
        out += self._end(reason)
        return Piece(chunks=out, total_tokens=self.num_tokens, finish_reason=self.finish_reason,
                     reasoning_tokens=self.reasoning_tokens)

    def close(self) -> None:
        """Release the processor of a sample that will not finish (error, disconnect)."""
        if not self._proc.finished:
            self._proc.close()

    def _end(self, reason: str) -> list:
        self.finish_reason = reason
        out = []
        held = self._held_tokens()
        if held:          # the recipe drops them uncounted at finish: count them (their bytes stay dropped)
            out += self._out(self._proc.push(dr.InferenceChunk.text("", held)))
        out += self._out(self._proc.push(dr.InferenceChunk.finish(finish_reason(reason))))
        return out + self._out(self._proc.finish())

    def _held_tokens(self) -> int:
        """Trailing tokens whose bytes are an incomplete UTF-8 character (the output was cut inside
        one): the processor holds them waiting for the rest and reports them nowhere."""
        if self._decode is None or not self._ids:
            return 0
        tail = self._ids[-8:]
        if not self._decode(tail).endswith("\ufffd"):
            return 0
        for j in range(1, len(tail)):
            if not self._decode(tail[:-j]).endswith("\ufffd"):
                return j
        return len(tail)

    def _set_stop_suffix(self) -> None:
        """The stop string the last token completed: of the occurrences ending inside its text,
        the one ending first, the first listed on a tie (the recipe's choice); else the one
        ending nearest the end (a match the recipe held back)."""
        if not (self._include_stop and self._stops and self._decode):
            return
        text = self._decode(self._ids)
        before = len(self._decode(self._ids[:-1])) if self._ids else 0
        best = None                              # (end, list position, stop)
        for j, s in enumerate(self._stops):
            i = text.find(s, max(0, before - len(s) + 1))
            if i != -1 and i + len(s) > before:
                key = (i + len(s), j, s)
                best = key if best is None or key < best else best
        if best is None:
            for j, s in enumerate(self._stops):
                i = text.rfind(s)
                if i != -1:
                    key = (len(text) - i - len(s), j, s)
                    best = key if best is None or key < best else best
        if best is not None:
            self.stop_suffix = best[2]
