"""torch_npu at run time: which kernels exist, the log-once fallback to the reference op, input checks.

A wrapper checks its inputs against the kernel's documented contract with plain torch; a reason
string (or None) comes back from each check, and ``fallback`` calls the reference op of the same
name after logging the reason once per (op, reason).

Two module-level seams let a harness without Ascend hardware drive the wrappers' kernel paths
(bench/npu_stub.py, a contract stub of torch_npu and custom_ops that runs on CPU tensors) without
replacing any function here: ``NPU_DEVICE_TYPES`` (the device types ``device_why`` accepts) and
``FALLBACK_OBSERVERS`` (called on every fallback, where the log speaks once per reason). Serving
code never changes either.
"""
from __future__ import annotations

import importlib
import logging
from typing import Callable

import torch

from engine.ops import reference

log = logging.getLogger("engine.ops.npu")

HALF = (torch.bfloat16, torch.float16)
BF16 = (torch.bfloat16,)
_LOGGED: set[tuple[str, str]] = set()          # (op, reason) already logged
_AVAILABLE: dict[str, bool] = {}               # api name -> present in this runtime

# Device types whose tensors ``device_why`` counts as on an NPU. Only "npu" in serving; the stub in
# bench/npu_stub.py adds "cpu" while installed, so CPU tensors reach its kernels.
NPU_DEVICE_TYPES: tuple[str, ...] = ("npu",)
# Each is called as ``observer(op, reason)`` on every call that falls back (eager calls only: not
# while a graph is traced). Empty in serving; bench/npu_stub.py counts fallbacks per call with it.
FALLBACK_OBSERVERS: list[Callable[[str, str], None]] = []


def log_reference_op(op: str, reason: str) -> bool:
    """Log once per op name: "op X: no NPU kernel (reason); using the reference op". True if logged."""
    key = (op, "\0table")
    if key in _LOGGED:
        return False
    _LOGGED.add(key)
    log.info("op %s: no NPU kernel (%s); using the reference op", op, reason)
    return True


def log_fallback(op: str, reason: str) -> bool:
    """Log once per (op, reason) that a call fell back to the reference op. True if logged."""
    key = (op, reason)
    if key in _LOGGED or torch.compiler.is_compiling():     # graph tracers cannot call a logger
        return False
    _LOGGED.add(key)
    log.warning("op %s: input outside the NPU kernel's contract (%s); using the reference op for "
                "such calls", op, reason)
    return True


def fallback(op: str, reason: str, *args):
    """Log ``reason`` once for ``op``, tell ``FALLBACK_OBSERVERS``, then run the reference op of that
    name on ``args``."""
    log_fallback(op, reason)
    if FALLBACK_OBSERVERS and not torch.compiler.is_compiling():
        for observe in FALLBACK_OBSERVERS:
            observe(op, reason)
    return getattr(reference, op)(*args)


def dtype_why(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> str | None:
    """None if ``t``'s dtype is one the kernel takes, else the reason naming both."""
    if t.dtype in allowed:
        return None
    names = "/".join(str(d).removeprefix("torch.") for d in allowed)
    return f"{name} dtype {str(t.dtype).removeprefix('torch.')}, kernel path takes {names}"


def device_why(t: torch.Tensor) -> str | None:
    """None if ``t`` is on an NPU device (a type in ``NPU_DEVICE_TYPES``), else the reason."""
    return None if t.device.type in NPU_DEVICE_TYPES else f"tensors on {t.device.type}, not on an NPU device"


def first_reason(*reasons: str | None) -> str | None:
    """The first reason that is not None (None if every check passed)."""
    return next((r for r in reasons if r), None)


# torch_npu as ``npu_ops`` imported it: the wrappers read this global on their kernel path, which a
# graph tracer (npugraph_ex, torchair) follows, where it would break the graph at importlib
TORCH_NPU = None


def torch_npu_module():
    """The torch_npu module; reached only after a wrapper's checks passed (inputs on an NPU)."""
    return TORCH_NPU if TORCH_NPU is not None else importlib.import_module("torch_npu")


def custom_namespace():
    """``torch.ops.custom`` (cann-recipes-infer's custom ops); reached only after a wrapper's checks passed."""
    return torch.ops.custom


def load_custom_ops() -> bool:
    """Import cann-recipes-infer's ``custom_ops`` (registers ``torch.ops.custom.*``). False if absent."""
    try:
        importlib.import_module("custom_ops")
        return True
    except Exception as e:            # any failure means: no custom kernels from it
        key = ("custom_ops", "\0import")
        if key not in _LOGGED:
            _LOGGED.add(key)
            log.warning("custom op library custom_ops (cann-recipes-infer ops/ascendc) not importable "
                        "(%s: %s); torch.ops.custom kernels are used only if registered otherwise",
                        type(e).__name__, e)
        return False


def api_available(api: str, torch_npu) -> bool:
    """Whether ``api`` ("torch_npu.<name>" or "<ns>.<name>" of torch.ops) exists in this runtime (cached)."""
    if api not in _AVAILABLE:
        ns, _, name = api.partition(".")
        if ns == "torch_npu":
            ok = hasattr(torch_npu, name)
        else:
            try:                      # the namespace lookup raises when the op is not registered
                getattr(getattr(torch.ops, ns), name)
                ok = True
            except (AttributeError, RuntimeError):
                ok = False
        _AVAILABLE[api] = ok
    return _AVAILABLE[api]
