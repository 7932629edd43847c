"""The platform layer: which device a worker runs on, and its streams, events and graphs.

One ``Platform`` per process, made by ``detect``. The same code runs on Ascend NPUs (torch_npu),
CUDA and plain CPU: on CPU streams and events are ``None`` and the stream / core-limit helpers are
no-ops that still run their body, so model code never branches on the device.

    plat = detect("auto")            # or "cpu" | "cuda[:i]" | "npu[:i]"; None: $DSV4_DEVICE or "auto"
    plat.activate()                  # set the current device index (cuda / npu)
    s = plat.new_stream()
    with plat.side_stream(s):        # s waits for the work queued so far, then runs the body
        y = f(x)
    plat.join(s, y)                  # the current stream waits for s; y is safe to use here

``torch_npu`` is imported only on the npu path (never by ``import engine.platform``, nor by
``detect("cpu")`` / ``detect("auto")`` on a machine without it).
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

KINDS = ("npu", "cuda", "cpu")
FORMS = "auto, cpu, cuda, cuda:I, npu, npu:I"
_SPEC = re.compile(r"(auto|cpu|cuda|npu)(?::(\d+))?")
_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
_warned: set[str] = set()


class PlatformError(ValueError):
    """A device spec that is malformed or names hardware / software this machine does not have, or
    an operation the platform cannot do (graphs on cpu). The message names the bad value and the
    flag or key it came from."""


def _warn_once(key: str, msg: str) -> None:
    """Log ``msg`` as a warning the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        log.warning(msg)


@dataclass(frozen=True)
class Platform:
    """A resolved device. ``kind``: "npu" | "cuda" | "cpu"; ``device``: e.g. npu:0, cuda:1, cpu."""
    kind: str
    device: torch.device

    @property
    def dist_backend(self) -> str:
        """The torch.distributed backend for this device: "hccl" | "nccl" | "gloo"."""
        return _BACKENDS[self.kind]

    @property
    def graph_capable(self) -> bool:
        """True where ``new_graph`` / ``capture`` work (cuda, npu)."""
        return self.kind != "cpu"

    @property
    def _acc(self):
        """``torch.cuda`` or ``torch.npu`` (the latter exists once torch_npu is imported)."""
        return getattr(torch, self.kind)

    def activate(self) -> None:
        """Make ``device`` the current device of this process (cuda / npu; cpu: nothing)."""
        if self.kind != "cpu":
            self._acc.set_device(self.device)

    def total_memory(self) -> int | None:
        """Bytes of memory on ``device`` (cuda / npu: ``mem_get_info``'s total); None on cpu."""
        return None if self.kind == "cpu" else int(self._acc.mem_get_info(self.device)[1])

    @property
    def platform_version(self) -> str | None:
        """The Ascend generation of an npu device ("A2" | "A3" | "950", see ``soc_platform``); None
        on cuda / cpu or for an SoC name this table does not know."""
        return soc_platform(torch.npu.get_device_name(self.device)) if self.kind == "npu" else None

    # ---- streams and events --------------------------------------------------------------------
    def new_stream(self):
        """A new stream on ``device`` (torch.cuda.Stream / torch.npu.Stream); None on cpu."""
        return None if self.kind == "cpu" else self._acc.Stream(device=self.device)

    def current_stream(self):
        """The current stream of ``device``; None on cpu."""
        return None if self.kind == "cpu" else self._acc.current_stream(self.device)

    @contextmanager
    def side_stream(self, s):
        """Fork: ``s`` first waits for the work queued on the current stream, then the body runs
        with ``s`` current. ``s`` None (cpu): a plain context that just runs the body."""
        if s is None:
            yield
            return
        s.wait_stream(self.current_stream())
        with self._acc.stream(s):
            yield

    def join(self, s, *tensors: torch.Tensor) -> None:
        """Join: the current stream waits for ``s``; each tensor made on ``s`` is marked as used
        by the current stream (``record_stream``) so the caching allocator does not hand its memory
        out again while the current stream may still read it. ``s`` None: nothing."""
        if s is None:
            return
        cur = self.current_stream()
        cur.wait_stream(s)
        for t in tensors:
            t.record_stream(cur)

    def new_event(self, enable_timing: bool = False):
        """A new event (torch.cuda.Event / torch.npu.Event); None on cpu."""
        return None if self.kind == "cpu" else self._acc.Event(enable_timing=enable_timing)

    def synchronize(self) -> None:
        """Wait for all work queued on ``device`` (cpu: nothing to wait for)."""
        if self.kind != "cpu":
            self._acc.synchronize(self.device)

    # ---- graphs --------------------------------------------------------------------------------
    def _need_graphs(self, what: str) -> None:
        if self.kind == "cpu":
            raise PlatformError(f"{what}: graph mode needs a cuda or npu device; the platform is 'cpu'")

    def new_graph(self):
        """An empty graph to capture into (torch.cuda.CUDAGraph / torch.npu.NPUGraph).

        Raises:
            PlatformError: on cpu.
        """
        self._need_graphs("new_graph")
        return torch.cuda.CUDAGraph() if self.kind == "cuda" else torch.npu.NPUGraph()

    def graph_pool_handle(self):
        """A memory pool handle graphs can share (``capture(pool=...)``). Raises PlatformError on cpu."""
        self._need_graphs("graph_pool_handle")
        return self._acc.graph_pool_handle()

    @contextmanager
    def capture(self, graph, pool=None, stream=None):
        """Capture the body's device work into ``graph`` (torch.cuda.graph / torch.npu.graph).

        Raises:
            PlatformError: on cpu.
        """
        self._need_graphs("capture")
        with self._acc.graph(graph, pool=pool, stream=stream):
            yield

    # ---- memory and cores ----------------------------------------------------------------------
    def mem_get_info(self) -> tuple[int, int]:
        """(free_bytes, total_bytes) of the device; on cpu the host's (MemAvailable, MemTotal)."""
        if self.kind != "cpu":
            free, total = self._acc.mem_get_info(self.device)
            return int(free), int(total)
        return _host_mem()

    def limit_core(self, aic: int, aiv: int):
        """A context limiting the ops launched in it to ``aic`` AI-Cube and ``aiv`` AI-Vector cores
        (Ascend A3, ``torchair.scope.limit_core_num``); on cuda / cpu a no-op context.

        Raises:
            PlatformError: aic / aiv not positive ints, or aiv != 2 * aic (A3 pairs two vector
                cores with each cube core); on npu, torchair not importable.
        """
        for name, v in (("aic", aic), ("aiv", aiv)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise PlatformError(f"limit_core: {name}={v!r} must be a positive int")
        if aiv != 2 * aic:
            raise PlatformError(f"limit_core: aiv={aiv} must be 2 * aic (aic={aic}, so aiv={2 * aic})")
        if self.kind != "npu":
            return nullcontext()
        try:
            import torchair
        except ImportError as e:
            raise PlatformError(f"limit_core: enable_limit_core on npu needs torchair, which failed to "
                                f"import ({e})") from e
        return torchair.scope.limit_core_num(aic, aiv)


def soc_platform(soc_name: str) -> str | None:
    """Ascend SoC name (``torch.npu.get_device_name``) -> run-config ``platform_version``:
    Ascend910B* -> "A2", Ascend910_93* -> "A3" (Atlas A3), Ascend950* -> "950"; else None."""
    name = soc_name.replace(" ", "")
    for prefix, version in (("Ascend910_93", "A3"), ("Ascend910B", "A2"), ("Ascend950", "950")):
        if name.startswith(prefix):
            return version
    return None


def _host_mem() -> tuple[int, int]:
    """(MemAvailable, MemTotal) in bytes from /proc/meminfo, else from os.sysconf."""
    try:
        with open("/proc/meminfo") as f:
            kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if ":" in line)}
        return kb["MemAvailable"] * 1024, kb["MemTotal"] * 1024
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def parse_spec(spec: str, key: str = "--device") -> tuple[str, int | None]:
    """``spec`` -> (kind, index): "auto" | "cpu" | "cuda" | "npu", index None unless given. Checks
    the form only (no hardware probing, no torch_npu import).

    Raises:
        PlatformError: not one of auto, cpu, cuda, cuda:I, npu, npu:I (``key`` names the source).
    """
    m = _SPEC.fullmatch(spec.strip().lower()) if isinstance(spec, str) else None
    if m is None or (m[2] is not None and m[1] in ("auto", "cpu")):
        raise PlatformError(f"{key}: {spec!r} is not a device; expected one of {FORMS}")
    return m[1], None if m[2] is None else int(m[2])


def detect(spec: str | None = None, key: str | None = None) -> Platform:
    """Resolve a device spec to a ``Platform``.

    ``spec``: "auto" | "cpu" | "cuda" | "cuda:I" | "npu" | "npu:I"; None: $DSV4_DEVICE, else "auto".
    "auto" picks npu (torch_npu importable and an NPU visible), then cuda, then cpu; a torch_npu
    that fails to import is logged once and skipped. A missing index means 0. ``key``: the flag or
    variable named in errors (default "--device", or "DSV4_DEVICE" when the spec came from it).
    The current device is not changed here; call ``Platform.activate()``.

    Raises:
        PlatformError: a malformed spec, or an explicit npu / cuda this machine does not have
            (torch_npu not installed or failing to import, no device visible, no CUDA in this torch
            build, index out of range).
    """
    if spec is None:
        env = os.environ.get("DSV4_DEVICE", "")
        spec, key = (env, key or "DSV4_DEVICE") if env.strip() else ("auto", key)
    key = key or "--device"
    kind, index = parse_spec(spec, key)
    if kind == "auto":
        if _npu_usable():
            return _npu(spec, key, None)
        return _cuda(spec, key, None) if torch.cuda.is_available() else Platform("cpu", torch.device("cpu"))
    if kind == "cpu":
        return Platform("cpu", torch.device("cpu"))
    return _cuda(spec, key, index) if kind == "cuda" else _npu(spec, key, index)


def _import_torch_npu():
    """Import torch_npu (registers ``torch.npu``). Raises ImportError / RuntimeError / OSError."""
    return importlib.import_module("torch_npu")


def _npu_usable() -> bool:
    """auto mode: torch_npu installed, importable, and at least one NPU visible."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        _import_torch_npu()
        return bool(torch.npu.is_available()) and torch.npu.device_count() > 0
    except (ImportError, RuntimeError, OSError) as e:
        _warn_once("torch_npu-import", f"device auto: torch_npu is installed but unusable ({e}); "
                                       "falling back to cuda / cpu")
        return False


def _check_index(spec: str, key: str, index: int | None, count: int, what: str) -> int:
    index = 0 if index is None else index
    if index >= count:
        n = f"{count} {what} device is" if count == 1 else f"{count} {what} devices are"
        raise PlatformError(f"{key}: {spec!r} but only {n} visible")
    return index


def _npu(spec: str, key: str, index: int | None) -> Platform:
    if importlib.util.find_spec("torch_npu") is None:
        raise PlatformError(f"{key}: {spec!r} requested but torch_npu is not installed "
                            "(pip install 'dsv4-pd[npu]' with the CANN toolkit)")
    try:
        _import_torch_npu()
    except (ImportError, RuntimeError, OSError) as e:
        raise PlatformError(f"{key}: {spec!r} requested but torch_npu failed to import ({e})") from e
    count = torch.npu.device_count() if torch.npu.is_available() else 0
    if count == 0:
        raise PlatformError(f"{key}: {spec!r} requested but no NPU is visible "
                            "(check the driver and ASCEND_RT_VISIBLE_DEVICES)")
    return Platform("npu", torch.device("npu", _check_index(spec, key, index, count, "NPU")))


def _cuda(spec: str, key: str, index: int | None) -> Platform:
    if not torch.backends.cuda.is_built():
        raise PlatformError(f"{key}: {spec!r} requested but this torch build has no CUDA "
                            f"(torch {torch.__version__})")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise PlatformError(f"{key}: {spec!r} requested but no CUDA device is visible "
                            "(check the driver and CUDA_VISIBLE_DEVICES)")
    return Platform("cuda", torch.device("cuda", _check_index(spec, key, index, count, "CUDA")))
