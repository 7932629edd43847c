"""Self-describing wire format for one request's decode state (prefill -> decode).

A message is a list of frames: frame 0 is a msgpack header, frames 1..n the raw bytes of the
tensors it lists, in order (the names of ``engine.core.pd_state.state_tensors``). No pickle: the header
is msgpack of plain types, tensor bytes are reinterpreted with the dtype the header names.

One transfer is either a single ``state`` message, or (pushed while prefill runs) one ``layer``
message per layer as its state becomes final, then a ``commit`` carrying token #1 -- or a
``cancel`` (prefill failed, or token #1 already ended the sample).

MTP (``model_config.next_n`` > 0 on both sides, which the handshake layout's ``next_n`` enforces):
the MTP layers' window rings become final only with the step that samples token #1 (the MTP
catch-up pairs position L-1 with token #1), so they travel with the ``commit`` as its tensors
(``mtp.k.win_kv`` [+ ``.scale``], ``engine.core.pd_state.mtp_state_tensors``), with
``draft_ids``, the drafts prefill made after token #1 for decode's first verify step. A ``state``
message carries both the same way. Without MTP a commit has no tensors and no ``draft_ids`` key:
the bytes are those of a next_n 0 build. Header fields:

    v            format version (1)
    kind         state | layer | commit | cancel
    transfer_id  issued by the gateway, never reused (fencing)
    fingerprint  ``model_fingerprint`` of the sender's model (refused on mismatch)
    num_tokens   L, the prompt tokens the state covers            (state, layer, commit)
    first_token  token #1, sampled by prefill                      (state, commit)
    layer        the layer index the tensors belong to             (layer)
    num_layers   layers the transfer carried                       (commit)
    draft_ids    MTP drafts after token #1, <= MAX_DRAFTS token ids  (state, commit; optional)
    reason       why it was cancelled                              (cancel)
    tensors      [{name, dtype, shape, nbytes, crc32}] in frame order (empty for commit / cancel)
"""
from __future__ import annotations

import hashlib
import json
import zlib

import msgpack
import torch

VERSION = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
           "uint8": torch.uint8, "float8_e4m3fn": torch.float8_e4m3fn}
_NAMES = {v: k for k, v in _DTYPES.items()}
MAX_HEADER_BYTES = 1 << 20
MAX_DRAFTS = 16          # draft_ids per message (DeepSeek-V4 drafts at most 3: engine.run_config.MAX_NEXT_N)


class TransferError(ValueError):
    """A state message that must not be decoded: malformed, corrupted, or for another model."""


def model_fingerprint(config: dict, kv_dtype: torch.dtype, block_layout: dict | None = None) -> str:
    """sha256 over the checkpoint config (canonical JSON), the KV dtype and the state layout.

    Both sides compute it; equal fingerprints mean the state tensors mean the same thing.
    """
    blob = json.dumps({"config": config, "kv_dtype": _NAMES[kv_dtype], "layout": block_layout or {}},
                      sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


KINDS = {"state": (("num_tokens", int), ("first_token", int)),
         "layer": (("num_tokens", int), ("layer", int)),
         "commit": (("num_tokens", int), ("first_token", int), ("num_layers", int)),
         "cancel": (("reason", str),)}


def encode_state(transfer_id: str, fingerprint: str, num_tokens: int, first_token: int,
                 tensors: dict[str, torch.Tensor], draft_ids: list[int] | None = None) -> list[bytes | memoryview]:
    """The whole state in one message: header frame + one zero-copy frame per tensor. With MTP
    ``tensors`` include the ``mtp.*`` rows (``PDState.export_state``, ``engine/core/pd.py``) and ``draft_ids`` the
    drafts after token #1 (None: no ``draft_ids`` key). Raises ValueError: over ``MAX_DRAFTS``."""
    return _encode("state", transfer_id, fingerprint, tensors, num_tokens=num_tokens, first_token=first_token,
                   **_drafts(None, draft_ids))


def encode_layer(transfer_id: str, fingerprint: str, num_tokens: int, layer: int,
                 tensors: dict[str, torch.Tensor]) -> list[bytes | memoryview]:
    """One layer's state (``layers.{layer}.*`` tensors), pushed as soon as that layer is final."""
    return _encode("layer", transfer_id, fingerprint, tensors, num_tokens=num_tokens, layer=layer)


def encode_commit(transfer_id: str, fingerprint: str, num_tokens: int, first_token: int, num_layers: int,
                  mtp: dict[str, torch.Tensor] | None = None, draft_ids: list[int] | None = None
                  ) -> list[bytes | memoryview]:
    """Ends a layer-by-layer transfer: all ``num_layers`` layers were sent; token #1.

    MTP (both None without it: the message is then exactly a next_n 0 commit): ``mtp`` the MTP
    window rows (``mtp.*`` tensors, final only now), ``draft_ids`` the drafts after token #1.
    Raises ValueError: a tensor not named ``mtp.*``, or more than ``MAX_DRAFTS`` drafts.
    """
    bad = [n for n in (mtp or {}) if not n.startswith("mtp.")]
    if bad:
        raise ValueError(f"commit tensors: only the MTP state (mtp.*) travels with a commit, got {bad[0]!r}")
    return _encode("commit", transfer_id, fingerprint, mtp or {}, num_tokens=num_tokens, first_token=first_token,
                   num_layers=num_layers, **_drafts(mtp, draft_ids))


def _drafts(mtp, draft_ids) -> dict:
    """The optional ``draft_ids`` field: present once MTP state or drafts are sent."""
    if mtp is None and draft_ids is None:
        return {}
    ids = list(draft_ids or ())
    if len(ids) > MAX_DRAFTS:
        raise ValueError(f"draft_ids: {len(ids)} drafts exceed {MAX_DRAFTS}")
    return {"draft_ids": ids}


def encode_cancel(transfer_id: str, fingerprint: str, reason: str) -> list[bytes | memoryview]:
    """Tells decode to drop what it got for ``transfer_id`` and free the reservation."""
    return _encode("cancel", transfer_id, fingerprint, {}, reason=reason[:500])


def _encode(kind: str, transfer_id: str, fingerprint: str, tensors: dict[str, torch.Tensor],
            **fields) -> list[bytes | memoryview]:
    """Header frame + one zero-copy frame per tensor (moved to CPU, contiguous)."""
    metas, frames = [], []
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        buf = memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        metas.append({"name": name, "dtype": _NAMES[t.dtype], "shape": list(t.shape), "nbytes": buf.nbytes,
                      "crc32": zlib.crc32(buf)})
        frames.append(buf)
    header = {"v": VERSION, "kind": kind, "transfer_id": transfer_id, "fingerprint": fingerprint, **fields,
              "tensors": metas}
    return [msgpack.packb(header), *frames]


def decode_header(frame: bytes | memoryview) -> dict:
    """Parse and check the header frame. Raises TransferError naming what is wrong."""
    if len(frame) > MAX_HEADER_BYTES:
        raise TransferError(f"header: {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        h = msgpack.unpackb(bytes(frame), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise TransferError(f"header: not msgpack ({type(e).__name__})") from None
    if not isinstance(h, dict) or h.get("v") != VERSION:
        raise TransferError(f"header: expected a version {VERSION} map")
    if h.get("kind") not in KINDS:
        raise TransferError(f"header.kind: expected one of {sorted(KINDS)}, got {h.get('kind')!r}")
    for key, typ in (("transfer_id", str), ("fingerprint", str), ("tensors", list)) + KINDS[h["kind"]]:
        if not isinstance(h.get(key), typ) or isinstance(h.get(key), bool):
            raise TransferError(f"header.{key}: missing or not {typ.__name__}")
    if "draft_ids" in h:
        d = h["draft_ids"]
        if h["kind"] not in ("state", "commit") or not isinstance(d, list) or len(d) > MAX_DRAFTS or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in d):
            raise TransferError(f"header.draft_ids: expected up to {MAX_DRAFTS} token ids on a state / commit")
    for i, m in enumerate(h["tensors"]):
        ok = (isinstance(m, dict) and isinstance(m.get("name"), str) and m.get("dtype") in _DTYPES
              and isinstance(m.get("shape"), list) and all(isinstance(x, int) and x >= 0 for x in m["shape"])
              and isinstance(m.get("nbytes"), int) and isinstance(m.get("crc32"), int))
        if not ok:
            raise TransferError(f"header.tensors[{i}]: malformed entry")
        numel = 1
        for x in m["shape"]:
            numel *= x
        if numel * torch.empty(0, dtype=_DTYPES[m["dtype"]]).element_size() != m["nbytes"]:
            raise TransferError(f"header.tensors[{i}] ({m['name']}): nbytes does not match dtype x shape")
    return h


def decode_state(frames: list[bytes | memoryview], fingerprint: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Frames -> (header, name -> tensor). Checks version, model fingerprint, frame count, sizes
    and every tensor's crc32 before returning anything.

    Raises:
        TransferError: any mismatch (the message names the field or tensor).
    """
    if not frames:
        raise TransferError("message: no frames")
    h = decode_header(frames[0])
    return h, decode_tensors(h, frames, fingerprint)


def decode_tensors(h: dict, frames: list[bytes | memoryview], fingerprint: str) -> dict[str, torch.Tensor]:
    """The tensors of a message whose header ``h`` is already parsed (``decode_header(frames[0])``):
    name -> tensor (dtype and shape as listed, on CPU, copied out of the frames). Checks the model
    fingerprint, frame count, sizes and every tensor's crc32 before returning anything.

    Raises:
        TransferError: any mismatch (the message names the field or tensor).
    """
    if h["fingerprint"] != fingerprint:
        raise TransferError("header.fingerprint: the sender runs a different model / dtype / layout")
    metas = h["tensors"]
    if len(frames) != 1 + len(metas):
        raise TransferError(f"message: {len(frames) - 1} tensor frames for {len(metas)} listed tensors")
    out = {}
    for m, f in zip(metas, frames[1:]):
        buf = memoryview(f)
        if buf.nbytes != m["nbytes"]:
            raise TransferError(f"tensor {m['name']}: {buf.nbytes} bytes, header says {m['nbytes']} (truncated?)")
        if zlib.crc32(buf) != m["crc32"]:
            raise TransferError(f"tensor {m['name']}: checksum mismatch (corrupted)")
        raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf.nbytes else torch.empty(0, dtype=torch.uint8)
        out[m["name"]] = raw.view(_DTYPES[m["dtype"]]).reshape(m["shape"])
    return out
