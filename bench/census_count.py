"""Counters of the op census (``bench.census``): seam-op calls by path, and host syncs.

``OpRecorder.table(ops)`` wraps every op of an ``engine.ops.Ops`` table so that, while recording,
each call is counted under the path it took:

    reference   the table's entry is the reference op (``engine.ops.REFERENCE``)
    kernel      a platform wrapper that reached its kernel
    fallback    a platform wrapper whose input check failed: it ran the reference op, and the
                reason it gave (``engine.ops.npu.runtime.fallback``) is kept with the count

The wrappers keep ``__wrapped__`` (``functools.wraps``), so ``inspect.unwrap`` sees the table the
model would have had uncounted and every path decision in the model is the same.

``SyncCounter`` is a ``TorchFunctionMode`` that counts, per kind and per call site (the first
frame in this repository outside the torch library), every call that makes a device wait for
the host to read a result: ``item`` / ``tolist`` / ``bool`` / ``int`` / ``float`` / ``index`` of a
tensor, ``cpu`` / ``numpy`` / ``to("cpu")``, and ops whose output shape depends on the data
(``nonzero``, one-argument ``where``, ``unique``, ``masked_select``, ``bincount``,
``repeat_interleave`` with tensor repeats, indexing with a boolean tensor). On a CPU every
tensor is on the host, so a read of a tensor the step already copied to the host counts too.
On a CPU those calls cost nothing,
but on an NPU / GPU each one stalls the stream and cannot be captured in a graph. Calls made
inside the contract stub's kernels (``bench/npu_stub*``) are not counted: on an NPU those kernels
run on the device.
"""
from __future__ import annotations

import functools
import inspect
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from engine.ops import OP_NAMES, REFERENCE, Ops

ROOT = Path(__file__).resolve().parents[1]
_SKIP = (str(Path(__file__).resolve()), str(Path(torch.__file__).resolve().parent), str(ROOT / ".venv"))

T = torch.Tensor
# function -> sync kind
SYNC_KINDS = {
    T.item: "item", T.tolist: "tolist", T.__bool__: "bool", T.__int__: "int", T.__float__: "float",
    T.__index__: "index", T.cpu: "cpu", T.numpy: "numpy",
    T.nonzero: "nonzero", torch.nonzero: "nonzero", torch.argwhere: "nonzero", T.argwhere: "nonzero",
    T.unique: "unique", torch.unique: "unique", torch.unique_consecutive: "unique", T.unique_consecutive: "unique",
    T.masked_select: "masked_select", torch.masked_select: "masked_select", torch.bincount: "bincount",
    T.bincount: "bincount",
}
_INDEXING = (T.__getitem__, T.__setitem__)


def _data_dependent(func, args, kwargs) -> str | None:
    """The kind of a call whose output size (or place) depends on the data in only some forms:
    ``repeat_interleave`` with tensor repeats, one-argument ``where``, ``to`` the host from a
    device, and indexing with a boolean tensor."""
    if func in _INDEXING and _bool_index(args):
        return "bool-mask index"
    if func in (torch.repeat_interleave, T.repeat_interleave):
        reps = args[1] if len(args) > 1 else kwargs.get("repeats")
        return "repeat_interleave" if isinstance(reps, torch.Tensor) and reps.numel() > 1 else None
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "nonzero"
    if func is T.to and args[0].device.type != "cpu":              # device -> host only
        dev = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        return "cpu" if dev is not None and torch.device(dev).type == "cpu" else None
    return None


def _bool_index(args) -> bool:
    """Whether an indexing call's key holds a boolean tensor (a data-dependent shape)."""
    key = args[1] if len(args) > 1 else None
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, torch.Tensor) and k.dtype == torch.bool and k.dim() > 0 for k in keys)


def call_site() -> str:
    """``path:line`` (relative to the repository) of the innermost frame in the repository outside
    this module and torch; "?" when there is none."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(str(ROOT)) and not name.startswith(_SKIP):
            return f"{Path(name).relative_to(ROOT)}:{f.f_lineno}"
        f = f.f_back
    return "?"


class SyncCounter(TorchFunctionMode):
    """Counts host syncs (see the module docstring) while active: ``kinds`` Counter by kind,
    ``sites`` Counter by (kind, call site). ``enabled`` False: passes everything through."""

    def __init__(self):
        super().__init__()
        self.kinds: Counter[str] = Counter()
        self.sites: Counter[tuple[str, str]] = Counter()
        self.enabled = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.enabled:
            kind = SYNC_KINDS.get(func) or _data_dependent(func, args, kwargs or {})
            site = call_site() if kind is not None else None
            if kind is not None and not site.startswith("bench/npu_stub"):
                self.kinds[kind] += 1
                self.sites[(kind, site)] += 1
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        return sum(self.kinds.values())

    def reset(self) -> None:
        self.kinds.clear()
        self.sites.clear()


class OpRecorder:
    """Seam-op calls by (op, path, reason) while ``active`` (see the module docstring)."""

    def __init__(self):
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self.active = False
        self._calls: list[list[str]] = []          # fallback reasons of the platform wrappers running now

    def table(self, ops: Ops) -> Ops:
        """``ops`` with every entry counted."""
        return ops.with_overrides(**{n: self._wrap(n, getattr(ops, n)) for n in OP_NAMES})

    def on_fallback(self, op: str, reason: str) -> None:
        """Observer for ``engine.ops.npu.runtime.FALLBACK_OBSERVERS``: the running wrapper fell back."""
        if self._calls:
            self._calls[-1].append(reason)

    def _wrap(self, name: str, fn):
        reference = inspect.unwrap(fn) is getattr(REFERENCE, name)

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            if reference:
                self.counts[(name, "reference", "")] += 1
                return fn(*args, **kwargs)
            self._calls.append([])
            try:
                out = fn(*args, **kwargs)
            finally:
                why = self._calls.pop()
            self.counts[(name, "fallback", why[0]) if why else (name, "kernel", "")] += 1
            return out
        return counted

    def reset(self) -> None:
        self.counts.clear()

    def by_op(self, per: int = 1) -> dict[str, dict]:
        """``{op: {"kernel": n, "reference": n, "fallback": {reason: n}}}`` of calls / ``per``."""
        out: dict[str, dict] = {}
        for (op, path, why), n in sorted(self.counts.items()):
            row = out.setdefault(op, {"kernel": 0, "reference": 0, "fallback": {}})
            if path == "fallback":
                row["fallback"][why] = row["fallback"].get(why, 0) + n / per
            else:
                row[path] += n / per
        return out
