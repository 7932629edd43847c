"""glibc's malloc told to keep freed host memory for reuse: no trimming of the heap below 1 GiB, no
``mmap`` per block below 32 MiB.

Why: a CPU step allocates and frees thousands of tensors of 0.1-30 MiB (dequantised weight tiles,
expert row blocks, attention scores). With glibc's defaults a block above its dynamic mmap
threshold is a fresh ``mmap`` and every page of it a zero-filled page fault, and a freed heap top
above the trim threshold goes back to the kernel, to fault in again on the next step. On a 2-core
VM (2026-12-08, ``bench.bench_prefill``, tiny-cpu-bench) that was a third of a prefill's time in
the kernel: the routed experts of one 256-token layer 30-60 -> 12-16 ms, dequantising a layer's 64
MXFP4 experts 30-50 -> 4-7 ms. vLLM's and SGLang's CPU backends get the same from tcmalloc
(``LD_PRELOAD``); these two ``mallopt`` calls need no library. The cost: memory a step freed stays
in the process (its peak resident size is kept, as with tcmalloc) until the heap top passes 1 GiB.

Skipped where it does not apply or the user chose: not glibc, an allocator preloaded
(``LD_PRELOAD`` naming tcmalloc / jemalloc / mimalloc), the user's own ``MALLOC_*_`` variables or
``glibc.malloc`` tunables, or ``DSV4_HOST_MALLOC=default``. Torch-free.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1                    # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 1 << 30
MMAP_THRESHOLD = 32 << 20                # glibc's ceiling for the dynamic threshold (64-bit)
USER_VARS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def why_not(environ: Mapping[str, str], platform: str = sys.platform) -> str | None:
    """None when ``tune`` should set the thresholds for a process with ``environ``, else the reason."""
    if environ.get("DSV4_HOST_MALLOC", "").lower() == "default":
        return "DSV4_HOST_MALLOC=default"
    if not platform.startswith("linux"):
        return f"not Linux ({platform})"
    preload = environ.get("LD_PRELOAD", "")
    if any(a in preload for a in ALLOCATORS):
        return f"an allocator is preloaded (LD_PRELOAD={preload})"
    if any(v in environ for v in USER_VARS) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "the environment sets glibc's malloc"
    return None


def tune(environ: Mapping[str, str] = os.environ) -> str:
    """Set the trim and mmap thresholds of this process's glibc malloc (once, at ``import engine``).

    Returns ``"set"``, or why nothing was set (not glibc, the user's own settings, a refused call).
    Never raises.
    """
    reason = why_not(environ)
    if reason is not None:
        return reason
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version                             # glibc only (musl has no mallopt thresholds)
    except (OSError, AttributeError):
        return "not glibc"
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "mallopt refused the thresholds"
    return "set"
