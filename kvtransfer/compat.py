"""Whether a prefill and a decode instance may exchange decode state: the one rule, torch-free.

The transfer handshake (``kvtransfer.transports``: hello / welcome) and the gateway's routing
(``server.backends.pd``: which prefill may serve which decode) both call ``handshake_mismatch``
on the same fields, so a pair the gateway chooses is a pair the handshake accepts. The fields
(a worker's ``handshake_fields``, also in its ``pong`` / ``/ready`` body under ``"handshake"``):

    transport    "zmq" | "dist"                   how the tensor bytes move
    backend      "gloo" | "nccl" | "hccl"         dist only: the data plane's collective backend
    fingerprint  ``wire.model_fingerprint``        sha256 over config, kv dtype and layout
    layout       dict compared key by key          the state layout and what the fingerprint
                                                   covers, named: ``kv_dtype``, ``cache_dtype``
                                                   (KV / indexer cache storage), ``config`` (a
                                                   short digest of config.json's keys),
                                                   ``weights`` (``engine.checkpoint.digest``),
                                                   ``next_n`` (MTP depth; absent reads as 0)

Imports nothing but the standard library, so the gateway process (which never loads torch) uses
it as is.
"""
from __future__ import annotations

# a pair's first difference -> the ``cause`` label of the gateway's ``dsv4:incompatible_pairs``
CAUSES = ("transport", "kv_dtype", "next_n", "weights", "config", "layout")

# layout keys a side may leave out, and what that means (a worker without MTP states no next_n)
LAYOUT_DEFAULTS = {"next_n": 0}
# why a key matters, added to its refusal where the values alone do not say it
_WHY = {"layout.next_n": "MTP draft tokens per step: a prefill running MTP ships its MTP window and drafts "
                         "with the commit; both sides must run the same next_n"}


def layout_diff(ours, theirs, path: str = "layout") -> list[tuple[str, object, object]]:
    """Dotted paths where two layouts differ, with (ours, theirs) values; missing keys show as None."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = []
        for k in sorted(set(ours) | set(theirs), key=str):
            out += layout_diff(ours.get(k), theirs.get(k), f"{path}.{k}")
        return out
    return [] if ours == theirs else [(path, ours, theirs)]


def _short(v, n: int = 60) -> str:
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def handshake_diffs(mine: dict, theirs: dict) -> list[tuple[str, object, object]]:
    """(key, mine, theirs) for every compared field that differs: "transport", "backend", dotted
    layout paths ("layout.weights", ...), and "fingerprint" only when nothing else explains it.
    Empty when the two sides may exchange state."""
    diffs = [(k, mine.get(k), theirs.get(k)) for k in ("transport", "backend") if mine.get(k) != theirs.get(k)]
    diffs += layout_diff(_with_defaults(mine.get("layout")), _with_defaults(theirs.get("layout")))
    if not diffs and mine.get("fingerprint") != theirs.get("fingerprint"):
        diffs.append(("fingerprint", mine.get("fingerprint"), theirs.get("fingerprint")))
    return diffs


def _with_defaults(layout):
    return {**LAYOUT_DEFAULTS, **layout} if isinstance(layout, dict) else layout


def handshake_mismatch(mine: dict, theirs: dict, me: str, them: str) -> str | None:
    """Why two sides must not exchange state, or None when they agree.

    ``mine`` / ``theirs``: dicts with "transport", "fingerprint", "layout" (and "backend" for dist).
    ``me`` / ``them`` name the sides in the reason ("decode", "prefill").
    """
    reasons = []
    diffs = handshake_diffs(mine, theirs)
    for key, a, b in diffs[:8]:
        if key in ("transport", "backend"):
            reasons.append(f"{key} differs: {them} uses {b!r}, {me} uses {a!r}")
        elif key == "fingerprint":
            reasons.append(f"fingerprint differs: {them} runs model {str(b)[:16]}, {me} runs {str(a)[:16]} "
                           "(checkpoint config / kv dtype / state layout differ)")
        else:
            why = f" ({_WHY[key]})" if key in _WHY else ""
            reasons.append(f"{key} differs: {them} has {_short(b)}, {me} has {_short(a)}{why}")
    if len(diffs) > 8:
        reasons.append(f"... and {len(diffs) - 8} more layout keys")
    return "; ".join(reasons) or None


def mismatch_cause(mine: dict, theirs: dict) -> str | None:
    """The first difference as one of ``CAUSES`` (a metric label), or None when they agree."""
    diffs = handshake_diffs(mine, theirs)
    if not diffs:
        return None
    key = diffs[0][0]
    if key in ("transport", "backend"):
        return "transport"
    if any(k == "layout.kv_dtype" or k.startswith("layout.cache_dtype") for k, _, _ in diffs):
        return "kv_dtype"
    if any(k == "layout.next_n" for k, _, _ in diffs):
        return "next_n"
    for cause in ("weights", "config"):
        if any(k == f"layout.{cause}" for k, _, _ in diffs):
            return cause
    return "config" if key == "fingerprint" else "layout"


def pair_mismatch(prefill: dict | None, decode: dict | None) -> str | None:
    """Why a prefill instance must not push state to a decode instance (their ``handshake``
    fields), worded as decode's side of the handshake words it; None when they pair. A side
    whose fields are unknown (``None``: no pong yet) is not judged here: the handshake still is."""
    if prefill is None or decode is None:
        return None
    return handshake_mismatch(decode, prefill, me="decode", them="prefill")
