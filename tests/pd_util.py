"""What the P/D process tests share: starting a ``LocalPD`` on the tiny flash checkpoint, random
token prompts, and waiting until workers hold no state."""
from __future__ import annotations

import time

import pytest
import torch

from server.launcher import LocalPD, log_tail

CONFIG = "configs/tiny-flash.yaml"


def start_pd(ckpt: str, log, num_prefill: int = 1, num_decode: int = 1, flags: list[str] = (),
             cluster_secret: str | None = None, config: str = CONFIG) -> LocalPD:
    """A started LocalPD with ``flags`` on every process (``pd.log``: its log); fails the test
    with the log's tail if it does not come up."""
    pd = LocalPD(config, ckpt, num_prefill=num_prefill, num_decode=num_decode, log_path=str(log),
                 cluster_secret=cluster_secret, extra_args={r: list(flags) for r in ("prefill", "decode", "gateway")})
    try:
        pd.start(timeout_s=300)
    except RuntimeError as e:
        pytest.fail(f"{e}\n{log_tail(log, 40)}")
    pd.log = log
    return pd


def rand_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1000, 60000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def wait_idle(pd: LocalPD, names, timeout_s: float = 30) -> None:
    """Every worker named holds nothing: all blocks free, nothing reserved, running, waiting or queued."""
    end = time.monotonic() + timeout_s
    while True:
        loads = {n: pd.ready(n) for n in names}
        busy = {n: ld for n, ld in loads.items() if ld["free_blocks"] != ld["total_blocks"] or ld["reserved"]
                or ld["running"] or ld["waiting"] or ld.get("queued")}
        if not busy:
            return
        if time.monotonic() > end:
            pytest.fail(f"state not freed: {busy}")
        time.sleep(0.1)
