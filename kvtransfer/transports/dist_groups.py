"""The torch.distributed side of the dist transport (``kvtransfer.transports.dist``): the backend
per device, a 2-rank process group per sender / receiver pair, the plan of group ops both sides
derive from a header, and flat byte views of frames.
"""
from __future__ import annotations

import datetime
import importlib
import socket
import warnings

import torch
import torch.distributed as dist


def backend_for(device: str | torch.device) -> str:
    """'cpu' -> 'gloo', 'cuda' -> 'nccl', 'npu' -> 'hccl'. Raises ValueError for other devices."""
    kind = torch.device(device).type
    try:
        return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[kind]
    except KeyError:
        raise ValueError(f"dist transport: no backend for device {device!r} (cpu, cuda, npu)") from None


def make_pair_group(backend: str, store, rank: int, timeout_s: float, host: str | None = None):
    """A 2-rank process group on ``store`` (a PrefixStore unique to the pair); blocks until both join.

    ``host``: the local address gloo listens on (default: gloo's choice from the hostname).
    Raises RuntimeError (from c10d) on rendezvous timeout.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        G = dist.ProcessGroupGloo
        opts = G._Options()
        opts._devices = [G.create_device(hostname=host) if host else G.create_default_device()]
        opts._timeout = timeout
        return G(store, rank, 2, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = False
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    if backend == "hccl":
        importlib.import_module("torch_npu")   # registers torch.distributed.ProcessGroupHCCL
        if hasattr(dist, "ProcessGroupHCCL"):   # documented: ProcessGroupHCCL(store, rank, size, timeout)
            return dist.ProcessGroupHCCL(store, rank, 2, timeout)
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL
        opts = ProcessGroupHCCL.Options()
        opts._timeout = timeout
        return ProcessGroupHCCL(store, rank, 2, opts)
    raise ValueError(f"unknown backend {backend!r}")


def transfer_plan(sizes: list[int], coalesce_bytes: int) -> list[list[int]]:
    """Frame indices per group op: one packed op for all frames in (0, coalesce_bytes), first,
    then one op per larger frame. Empty frames are in no op. Both sides compute the same plan."""
    small = [i for i, n in enumerate(sizes) if 0 < n < coalesce_bytes]
    return ([small] if small else []) + [[i] for i, n in enumerate(sizes) if n >= coalesce_bytes and n > 0]


def as_u8(frame, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over the frame's bytes (zero-copy for CPU buffers), moved to ``device``."""
    if isinstance(frame, torch.Tensor):
        t = frame.detach().contiguous().reshape(-1).view(torch.uint8)
    else:
        mv = memoryview(frame)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        with warnings.catch_warnings():   # read-only buffers: we only read them
            warnings.simplefilter("ignore")
            t = torch.frombuffer(mv, dtype=torch.uint8)
    return t if t.device == device else t.to(device)


def wait_all(works: list) -> None:
    """Wait for c10d works in order. Raises RuntimeError from the backend (peer gone, op timeout).

    Blocking: gloo send/recv works have no future and ``is_completed`` only turns true inside
    ``wait``; neither ``abort`` nor ``shutdown`` interrupts a pending wait. A wait ends when the
    data arrives, the peer closes its group, or ``op_timeout_s`` passes.
    """
    for w in works:
        w.wait()


def local_ip_towards(host: str) -> str:
    """The local address that routes to ``host`` (no packet is sent)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1" if host != "::1" else "::1"
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def tcp_host(zdest: str) -> str:
    if zdest.startswith("tcp://"):
        hostport = zdest[6:]
        host = hostport.rsplit(":", 1)[0]
        return host.strip("[]")
    return "127.0.0.1"   # ipc control: same machine
