"""The DeepSeek-V4 tokenizer: ``tokenizer.json`` of the checkpoint directory, via ``tokenizers``."""
from __future__ import annotations

import functools

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from engine.config import read_json_object

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"


class TokenizerError(ValueError):
    """The checkpoint directory has no usable tokenizer."""


def _token_text(cfg: dict, key: str, default: str) -> str:
    v = cfg.get(key)
    v = v.get("content") if isinstance(v, dict) else v
    if v is None:
        return default
    if not isinstance(v, str):
        raise TokenizerError(f"tokenizer_config.json: '{key}' must be a string or an AddedToken object, found {v!r}")
    return v


class Tokenizer:
    """Encode / decode token ids with the checkpoint's ``tokenizer.json``.

    Raises:
        TokenizerError: ``tokenizer.json`` missing or unreadable, or BOS / EOS not in the vocab.
    """

    def __init__(self, ckpt_dir: str | Path):
        self.model_dir = Path(ckpt_dir)
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"tokenizer: {path} not found")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on parse errors
            raise TokenizerError(f"tokenizer: cannot read {path}: {e}") from None
        cfg_path = Path(ckpt_dir) / "tokenizer_config.json"
        cfg = read_json_object(cfg_path, TokenizerError) if cfg_path.is_file() else {}
        bos = _token_text(cfg, "bos_token", BOS_TOKEN)
        eos = _token_text(cfg, "eos_token", EOS_TOKEN)
        self.bos_id, self.eos_id = self._tok.token_to_id(bos), self._tok.token_to_id(eos)
        if self.bos_id is None or self.eos_id is None:
            raise TokenizerError(f"tokenizer: BOS {bos!r} or EOS {eos!r} missing from {path}")

    @property
    def vocab_size(self) -> int:
        """Number of ids including added special tokens (129280 for DeepSeek-V4)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can cover (its longest vocabulary string; byte-level BPE
        spells a byte as one character), so a text of C characters has >= C / this many tokens."""
        return max(1, max(len(t) for t in self._tok.get_vocab(with_added_tokens=True)))

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Text -> ids (special-token strings in ``text`` map to their ids); BOS prepended if asked."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Ids -> text."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
