"""Constrained decoding: a sample's grammar (``SamplingParams.structured``) as a token bitmask.

The gateway turns a request's output constraint into an xgrammar structural tag (JSON text);
each worker compiles it here against the checkpoint's tokenizer (xgrammar's ``GrammarCompiler``,
whose cache is keyed by the tag text, so a schema compiles once per worker) and keeps one
``GrammarMatcher`` per sample. Before a step samples, every constrained row's allowed tokens are
filled into an int32 bitmask ``[B, ceil(V / 32)]`` on the host, copied to the logits' device and
applied there (xgrammar's kernel for the device: CPU, Triton on CUDA, torch ops on NPU); tokens
outside it get -inf. A step without constrained rows does none of this.

With MTP a sample verifies drafts ``d_1 .. d_k`` in one step: row j is masked by the matcher's
state after ``d_1 .. d_j`` (accepted tentatively, then rolled back), which is the state a plain
step would have if those drafts are kept, so every kept token is sampled exactly as without MTP.
A draft the grammar refuses ends the chain: the rows past it are never kept.

xgrammar (and transformers, which it imports) is loaded on the first constrained request.
"""
from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from engine.core.request import FinishReason, RequestError, Sequence

if TYPE_CHECKING:              # annotations only: the engine imports this module without torch
    import torch

log = logging.getLogger(__name__)

# compiled grammars kept (LRU); one is ~1 MiB for DeepSeek-V4's vocab
CACHE_LIMIT_BYTES = 256 << 20
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


class GrammarBackend:
    """Compiles structural tags for one tokenizer and makes matchers.

    Args:
        tokenizer_dir: directory with ``tokenizer.json`` (the checkpoint).
        vocab_size: the model's vocab (the bitmask's width; ids past the tokenizer's are never allowed).
        stop_ids: token ids that end a sample (EOS): what a complete grammar allows next.
    """

    def __init__(self, tokenizer_dir: str | Path, vocab_size: int, stop_ids: tuple[int, ...]):
        self.tokenizer_dir, self.vocab_size, self.stop_ids = Path(tokenizer_dir), vocab_size, tuple(stop_ids)
        self._compiler = None
        self._lock = threading.Lock()
        self.compiled = 0                  # tags compiled (cache misses)

    def _load(self):
        import xgrammar as xgr
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(self.tokenizer_dir / "tokenizer.json"))
        # Added tokens never match as text. Special ones (BOS / EOS, placeholders) get none: a
        # grammar never allows them (EOS still ends a complete grammar, as a stop token). The chat
        # format's markers (``</think>``, ``｜DSML｜``: non-special) get a \x01 in front, which no
        # JSON text admits: a grammar names them as tokens (by id), and a JSON string cannot hold one.
        added = {t.content: t.special for t in tok.get_added_tokens_decoder().values()}
        vocab = [""] * self.vocab_size
        for text, i in tok.get_vocab(with_added_tokens=True).items():
            if i < self.vocab_size and not added.get(text, False):
                vocab[i] = "\x01" + text if text in added else text
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
        info = xgr.TokenizerInfo(vocab, xgr.VocabType(meta["vocab_type"]), vocab_size=self.vocab_size,
                                 stop_token_ids=list(self.stop_ids), add_prefix_space=meta["add_prefix_space"])
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                   cache_limit_bytes=CACHE_LIMIT_BYTES)

    def compile(self, tag: str):
        """The compiled grammar of a structural tag (xgrammar's cache: once per distinct text).

        Raises:
            RequestError: naming ``structured``: not a structural tag, an invalid schema / regex,
                or a feature xgrammar does not support (its message).
        """
        try:
            with self._lock:
                if self._compiler is None:
                    self._compiler = self._load()
                comp = self._compiler
            before = comp.get_cache_size_bytes()
            g = comp.compile_structural_tag(tag)
            self.compiled += comp.get_cache_size_bytes() != before
            return g
        except Exception as e:                # xgrammar raises RuntimeError / ValueError / its own types
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            msg = _LOG_PREFIX.sub("", msg)[:300]       # "[hh:mm:ss] file.cc:line: " of xgrammar's C++ checks
            raise RequestError(f"structured: the output constraint cannot be compiled: {msg}") from None

    def matcher(self, tag: str, output_ids: list[int] = ()):
        """A fresh matcher for ``tag`` that has consumed ``output_ids`` (a migrated stream's tokens).

        Raises:
            RequestError: the tag does not compile (``compile``), or ``output_ids`` break it.
        """
        import xgrammar as xgr

        m = xgr.GrammarMatcher(self.compile(tag))
        for t in output_ids:
            if not m.accept_token(t):
                raise RequestError(f"output_ids: token {t} is not allowed by the output constraint")
        return m


def token_bitmask(seqs: list[Sequence], num_rows: int, vocab: int, device: torch.device
                  ) -> tuple[torch.Tensor, list[int]] | None:
    """The allowed tokens of a step's rows: ``seqs`` in row order, each with ``1 + spec_k`` rows.

    Returns None when no sequence has a matcher (nothing to do, nothing copied); else the bitmask
    ``[num_rows, ceil(vocab / 32)]`` int32 on ``device`` and the rows it constrains.
    """
    if all(s.matcher is None for s in seqs):
        return None
    import xgrammar as xgr

    bm = xgr.allocate_token_bitmask(num_rows, vocab)
    rows, i = [], 0
    for s in seqs:
        m, k = s.matcher, s.spec_k
        if m is not None:
            taken = 0
            for j in range(k + 1):
                m.fill_next_token_bitmask(bm, i + j)
                rows.append(i + j)
                # a draft the row's mask refuses is not offered to the matcher (xgrammar logs
                # each refused special token); the rows past it are never kept
                d = s.draft_ids[j] if j < k else -1
                if d < 0 or not (int(bm[i + j, d >> 5]) >> (d & 31)) & 1 or not m.accept_token(d):
                    break
                taken += 1
                if m.is_terminated():       # nor rows past a draft that completes the grammar
                    break
            if taken:
                m.rollback(taken)
        i += 1 + k
    return bm.to(device, non_blocking=True), rows


def apply_token_bitmask(logits: torch.Tensor, mask: tuple[torch.Tensor, list[int]]) -> None:
    """-inf, in place, on ``logits`` ``[B, V]`` fp32 where ``mask`` (``token_bitmask``) has a 0 bit."""
    import xgrammar as xgr

    bitmask, rows = mask
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)


def accept(s: Sequence, token: int) -> FinishReason | None:
    """Advance ``s``'s matcher by its new token: STOP once the grammar is complete (its stop token
    accepted), ABORT (logged) when the token breaks the grammar (a row sampled without its mask:
    never expected), else None."""
    m = s.matcher
    if not m.accept_token(token):
        log.error("request %s: token %d at output position %d breaks its output constraint; aborted",
                  s.seq_id, token, len(s.output_ids))
        return FinishReason.ABORT
    return FinishReason.STOP if m.is_terminated() else None
