"""Shared fixtures: tiny checkpoints written by dsv4-make-tiny (once per session), the flash one
as a path string, the real-width Flash checkpoint (once per session, removed at its end), and an
in-process reference engine on configs/tiny-flash.yaml (a module may define its own ``ckpt`` /
``reference``)."""
from __future__ import annotations

import ctypes
import gc
import os
import shutil

import engine  # noqa: F401  - sets MKL_CBWR before any GEMM (engine/__init__.py)
import pytest
import torch

from engine.build import build_engine
from engine.run_config import RunConfig
from engine.checkpoint.make_tiny import make_tiny
from server.launch.local import log_tail


def pytest_configure(config):
    """Under pytest-xdist (``-n N``, the default in pyproject.toml) each worker gets
    ``cpu_count // N`` torch threads, and so do the processes its tests start (``OMP_NUM_THREADS``
    is inherited). Two workers each running two OpenMP threads on two cores spin against each other
    and take longer than one worker; one thread each keeps both cores busy with no contention."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's process logs (``*.log`` under its tmp_path) go into its report: CI shows
    only the report, and the logs say why a worker went away."""
    rep = (yield).get_result()
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if rep.failed and tmp is not None:
        for f in sorted(tmp.rglob("*.log")):
            rep.sections.append((f"log tail: {f.name}", log_tail(f, 60)))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Factory: ``tiny_ckpt(preset, seed, mtp_agree=False)`` -> path of a tiny checkpoint (cached
    per session; ``mtp_agree``: ``dsv4-make-tiny --mtp-agree``, an MTP layer the trunk agrees with)."""
    cache: dict[tuple[str, int, bool], object] = {}

    def get(preset: str = "flash", seed: int = 1, mtp_agree: bool = False):
        key = (preset, seed, mtp_agree)
        if key not in cache:
            name = f"tiny-{preset}-{seed}" + ("-agree" if mtp_agree else "")
            cache[key] = make_tiny(preset, seed, tmp_path_factory.mktemp(name), mtp_agree=mtp_agree)
        return cache[key]

    return get


@pytest.fixture(scope="module", autouse=True)
def _return_freed_memory():
    """After each module: collect cycles and hand freed heap pages back to the OS. One pytest
    process builds an in-process engine per module (model + state pools, ~1 GB); without the
    trim, glibc keeps the freed heap and the session's RSS only climbs."""
    yield
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass                                             # not glibc: nothing to trim


@pytest.fixture(scope="module")
def real_width_ckpt(tmp_path_factory):
    """Path of ``dsv4-make-tiny --preset flash-real-width --seed 0`` (2.9 GB, about a minute on 2
    cores): written for the one module that uses it, deleted when that module ends (pytest keeps
    old temp dirs; 2.9 GB of page cache should not stay for the rest of the session)."""
    d = tmp_path_factory.mktemp("flash-real-width")
    yield make_tiny("flash-real-width", 0, d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt) -> str:
    """The tiny flash checkpoint (seed 1) the P/D process tests serve."""
    return str(tiny_ckpt("flash", 1))


@pytest.fixture(scope="module")
def reference(ckpt):
    """An in-process engine on configs/tiny-flash.yaml: the tokens the P/D service must match."""
    return build_engine(RunConfig.from_yaml("configs/tiny-flash.yaml"), ckpt, progress=False)
