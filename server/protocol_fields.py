"""The control protocol's frames and field codecs (``server.protocol``'s messages use them): one
msgpack map per ZMQ frame of at most ``MAX_MESSAGE_BYTES``, sampling parameters and logprobs as
plain types, and the checks of the fields every message carries. Torch-free."""
from __future__ import annotations

import dataclasses

import msgpack

from engine.core.sampling_params import Sampled, SamplingParams

MAX_MESSAGE_BYTES = 64 << 20


class MessageError(ValueError):
    """A control message that is not a msgpack map with the fields its op needs (names the field)."""


def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(frame: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    """One frame -> its map (with an ``"op"`` string). Raises MessageError for oversize,
    non-msgpack or non-map frames."""
    if len(frame) > max_bytes:
        raise MessageError(f"message of {len(frame)} bytes exceeds {max_bytes}")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:   # msgpack raises several unrelated types on garbage
        raise MessageError(f"not msgpack ({type(e).__name__})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise MessageError("expected a map with an 'op' string")
    return msg


def params_to_dict(p: SamplingParams) -> dict:
    d = dataclasses.asdict(p)
    d["stop_token_ids"] = list(d["stop_token_ids"])
    return d


def params_from_dict(d) -> SamplingParams:
    """Raises MessageError (not a map / unknown field) or SamplingError (a bad value)."""
    if not isinstance(d, dict):
        raise MessageError("params: expected a map")
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(d) - names
    if unknown:
        raise MessageError(f"params: unknown fields {sorted(unknown)[:4]}")
    try:
        return SamplingParams(**d)
    except (TypeError, OverflowError) as e:       # a value of the wrong type
        raise MessageError(f"params: {e}") from None


def pack_sampled(s: list[Sampled] | None) -> list | None:
    """[[logprob, [[id, logprob], ...] or None], ...] (token ids travel separately)."""
    if s is None:
        return None
    return [[x.logprob, [list(t) for t in x.top_logprobs] if x.top_logprobs is not None else None] for x in s]


def unpack_sampled(ids: list[int], lps: list | None) -> list[Sampled] | None:
    if lps is None:
        return None
    return [Sampled(t, lp, [tuple(a) for a in top] if top is not None else None) for t, (lp, top) in zip(ids, lps)]


def check_ids(v, field: str) -> list[int]:
    # set(map(type, ...)) runs in C: ~4x faster than a generator of isinstance checks, which adds
    # up on the TTFT path for long prompts (both workers check). msgpack gives exact ints; a bool
    # (type bool) or any other type fails.
    if not isinstance(v, list) or not set(map(type, v)) <= {int}:
        raise MessageError(f"{field}: expected a list of ints")
    return v


def check_rid(msg: dict) -> str:
    """``msg["rid"]``, the transfer id. Raises MessageError."""
    rid = msg.get("rid")
    if not isinstance(rid, str):
        raise MessageError("rid: expected a string")
    return rid


def check_deadline(msg: dict) -> float | None:
    """``msg["deadline_s"]`` (seconds left, > 0) or None. Raises MessageError."""
    v = msg.get("deadline_s")
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 1e7:
        raise MessageError("deadline_s: expected seconds in (0, 1e7]")
    return float(v)


