"""launch-pd checks the memory plan (engine.memory_plan) before any rank starts or weight is read:
a layout that does not fit exits 2 at once with the plan's numbers; one that fits goes on to load.
The checkpoint directories hold only the real Flash config.json (as dsv4-convert-model --quant-type
w8a8-int writes it), no shards: reading weights would fail differently."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import pytest

from engine.config import ModelArgs
from engine.memory_plan import with_quant_type

LAUNCH = [sys.executable, "-m", "server.launch.cli"]
A3_16 = "configs/deepseek-v4-flash-a3-w8a8-16rank.yaml"


@pytest.fixture
def flash_w8a8(tmp_path):
    d = tmp_path / "flash-w8a8"
    d.mkdir()
    args = with_quant_type(ModelArgs.from_json("configs/models/deepseek-v4-flash"), "w8a8-int")
    (d / "config.json").write_text(json.dumps(args.to_dict(), indent=1))
    return d


def _yaml(tmp_path, **subs) -> str:
    text = open(A3_16).read()
    for old, new in subs.items():
        text = text.replace(old, new)
    (tmp_path / "run.yaml").write_text(text)
    return str(tmp_path / "run.yaml")


def _launch(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DSV4_DEVICE")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    r = subprocess.run(LAUNCH + ["--role", "decode", "--device", "cpu", *args], capture_output=True, text=True,
                       timeout=120, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return r, cpu, time.monotonic() - t0


def test_a_layout_that_does_not_fit_exits_2_in_under_a_second_before_reading_weights(tmp_path, flash_w8a8):
    """Flash W8A8 on 4 A3 dies (world_size 4, 64 GiB each): the routed experts alone are 64.6 GiB
    a die. Nothing is spawned, no torch imported, no shard opened: the process's CPU time, Python's
    start included, stays under a second (wall time too on an idle machine)."""
    yaml = _yaml(tmp_path, **{"world_size: 16": "world_size: 4", "batch_size: 256": "batch_size: 64"})
    r, cpu, wall = _launch("--config", yaml, "--model", str(flash_w8a8), "--device-memory-gib", "64")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("launch-pd: memory plan: DeepSeek-V4-Flash (w8a8-int) on 4 rank(s) of 64 GiB "
                               "(--device-memory-gib) does not fit: weights 75.38 GiB + workspace 6.91 GiB exceed the "
                               "54.40 GiB budget (64 GiB x mem_fraction_static 0.85) by 27.90 GiB"), r.stderr
    assert "Change: more ranks: parallel_config.world_size 8 (4 chips)" in r.stderr
    assert "shard" not in r.stderr.lower() and "rank 1" not in r.stderr
    assert cpu < 1.0, f"{cpu:.2f} s of CPU ({wall:.2f} s wall)"


def test_a_layout_that_fits_goes_on_to_read_the_weights(tmp_path, flash_w8a8):
    """The same checkpoint on one rank of a 1 TiB device (no platform named: no rank minimum)
    passes the plan and fails where the weights are read: there are none."""
    yaml = _yaml(tmp_path, **{'  platform_version: "A3"\n': "", "world_size: 16": "world_size: 1",
                              "batch_size: 256": "batch_size: 16", "lmhead_tp_size: 4": "lmhead_tp_size: 1"})
    r, _, _ = _launch("--config", yaml, "--model", str(flash_w8a8), "--device-memory-gib", "1024",
                      "--log-level", "info")
    assert r.returncode == 2
    assert "memory plan: DeepSeek-V4-Flash (w8a8-int) fits" in r.stderr
    assert "does not fit" not in r.stderr
    assert "launch-pd: checkpoint: no *.safetensors shards in" in r.stderr, r.stderr[-2000:]


def test_on_cpu_without_the_flag_there_is_no_plan(tmp_path, flash_w8a8):
    """CPU: the plan needs --device-memory-gib (the host's memory is every rank's); without it the
    same unfit layout gets as far as its ranks (here: a bad rank flag, checked next)."""
    yaml = _yaml(tmp_path, **{"world_size: 16": "world_size: 4", "batch_size: 256": "batch_size: 64"})
    r, _, _ = _launch("--config", yaml, "--model", str(flash_w8a8), "--rank-timeout-s", "0")
    assert r.returncode == 2 and "memory plan" not in r.stderr
    assert "--rank-timeout-s: 0.0 must be in [0.1, 3600] seconds" in r.stderr


def test_bad_device_memory_flag_exits_2(tmp_path, flash_w8a8):
    r, _, _ = _launch("--config", A3_16, "--device-memory-gib", "-1")
    assert r.returncode == 2 and "launch-pd: --device-memory-gib: -1.0 must be in (0, 2^20) GiB" in r.stderr
