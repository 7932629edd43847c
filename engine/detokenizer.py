"""Incremental detokenisation: generated token ids -> text deltas, never a broken UTF-8 char.

The DeepSeek-V4 tokenizer is byte-level BPE, so one character (Chinese, emoji) may span several
tokens; decoding a partial character yields U+FFFD. Standard vLLM / HF approach: decode a small
window ``ids[prefix_offset:]`` and subtract the text of ``ids[prefix_offset:read_offset]``
(already emitted); hold back while the window's text ends with U+FFFD. Cost per token is
O(window), not O(sequence). Concatenating all ``push`` results and ``flush()`` equals
``tokenizer.decode(generated_ids, skip_special_tokens)``.

Special tokens (reference section 6): only BOS / EOS are "special" in DeepSeek-V4's tokenizer;
``<think>``, ``</think>``, ``｜DSML｜``, ``<｜User｜>``... are plain added tokens and are always
decoded, so the output parsers see them.
"""
from __future__ import annotations

# Prompt tokens used as initial decoding context (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turn generated ids into text pieces.

    Args:
        tokenizer: ``engine.tokenizer.Tokenizer`` (anything with ``decode(ids, skip_special_tokens)``).
        prompt_ids: the prompt; its last few ids are decoding context only (never emitted).
        skip_special_tokens: drop BOS / EOS text (default True).
    """

    def __init__(self, tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        self._prefix = 0                  # start of the decoding window
        self._read = len(self._ids)       # ids before this are already emitted
        self.token_ids: list[int] = []    # generated ids pushed so far

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ("" while a character is incomplete)."""
        self.token_ids.append(token_id)
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return the held-back rest (may contain U+FFFD if the output ended mid-character)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if not final and (len(text) <= len(prefix_text) or text.endswith("\ufffd")):
            return ""         # nothing visible yet, or a character still incomplete
        new = text[len(prefix_text):]
        # the window restarts at the last emitted boundary
        self._prefix, self._read = self._read, len(self._ids)
        return new
