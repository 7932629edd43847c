"""engine.platform on this CPU machine (no CUDA, no torch_npu): device resolution and its errors,
the cpu no-op stream / event / core-limit helpers, and ``launch-pd --device`` naming the flag."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from engine.platform import Platform, PlatformError, detect, parse_spec

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or importlib.util.find_spec("torch_npu") is not None,
                                reason="expects a CPU-only machine (no CUDA, no torch_npu)")
CPU = Platform("cpu", torch.device("cpu"))


def test_detect_cpu_and_auto(monkeypatch):
    monkeypatch.delenv("DSV4_DEVICE", raising=False)
    for spec in ("cpu", "auto", " CPU ", None):
        p = detect(spec)
        assert p == CPU and p.device == torch.device("cpu") and p.kind == "cpu"
    assert not CPU.graph_capable
    CPU.activate()                                  # nothing to set on cpu


def test_dsv4_device_env_is_honoured(monkeypatch):
    monkeypatch.setenv("DSV4_DEVICE", "cpu")
    assert detect() == CPU
    monkeypatch.setenv("DSV4_DEVICE", "tpu")
    with pytest.raises(PlatformError, match=r"DSV4_DEVICE: 'tpu' is not a device"):
        detect()
    assert detect("cpu") == CPU                     # an explicit spec wins over the environment
    monkeypatch.setenv("DSV4_DEVICE", "")
    assert detect() == CPU                          # empty: auto


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "tpu", "cpu:0", "auto:1", "npu:", "", "cuda:-1"])
def test_bad_specs_list_the_accepted_forms(spec):
    with pytest.raises(PlatformError) as e:
        detect(spec)
    msg = str(e.value)
    assert msg.startswith(f"--device: {spec!r} is not a device") and "cuda:I" in msg and "npu:I" in msg
    with pytest.raises(PlatformError):
        parse_spec(spec)


def test_parse_spec_forms():
    assert parse_spec("auto") == ("auto", None)
    assert parse_spec("cuda:3") == ("cuda", 3)
    assert parse_spec("npu") == ("npu", None)


@pytest.mark.parametrize("spec,needle", [
    ("cuda", "this torch build has no CUDA"),
    ("cuda:0", "this torch build has no CUDA"),
    ("npu", "torch_npu is not installed"),
    ("npu:1", "torch_npu is not installed"),
])
def test_unavailable_devices_name_what_is_missing(spec, needle):
    with pytest.raises(PlatformError) as e:
        detect(spec)
    assert str(e.value).startswith(f"--device: {spec!r} requested but") and needle in str(e.value)
    with pytest.raises(PlatformError, match="^DSV4_DEVICE: "):
        detect(spec, key="DSV4_DEVICE")
    assert isinstance(e.value, ValueError)


def test_auto_never_imports_torch_npu():
    code = ("import sys, engine.platform as p; assert 'torch_npu' not in sys.modules; "
            "print(p.detect('auto').kind, p.detect('cpu').kind, 'torch_npu' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cpu", "cpu", "False"]


def test_dist_backend_per_kind():
    assert CPU.dist_backend == "gloo"
    # Platform is plain data: a cuda / npu one can be described without the hardware
    assert Platform("cuda", torch.device("cuda", 1)).dist_backend == "nccl"
    assert Platform("cuda", torch.device("cuda", 1)).graph_capable
    assert Platform("npu", torch.device("cpu")).dist_backend == "hccl"


def test_cpu_streams_and_events_are_none_and_helpers_run_the_body():
    assert CPU.new_stream() is None and CPU.current_stream() is None and CPU.new_event() is None
    CPU.synchronize()
    ran = []
    x = torch.ones(3)
    with CPU.side_stream(CPU.new_stream()):
        y = x * 2
        ran.append("side")
    CPU.join(None, y)
    with CPU.limit_core(8, 16):
        ran.append("limited")
    assert ran == ["side", "limited"] and y.tolist() == [2.0, 2.0, 2.0]


def test_graphs_need_an_accelerator():
    for call in (CPU.new_graph, CPU.graph_pool_handle):
        with pytest.raises(PlatformError, match="graph mode needs a cuda or npu device; the platform is 'cpu'"):
            call()
    with pytest.raises(PlatformError, match="^capture: "):
        with CPU.capture(None):
            pass


def test_mem_get_info_on_cpu():
    free, total = CPU.mem_get_info()
    assert type(free) is int and type(total) is int and 0 < free <= total


@pytest.mark.parametrize("aic,aiv,needle", [
    (8, 15, "aiv=15 must be 2 * aic"),
    (16, 16, "aiv=16 must be 2 * aic"),
    (0, 0, "aic=0 must be a positive int"),
    (-4, -8, "aic=-4 must be a positive int"),
    (8, 0, "aiv=0 must be a positive int"),
    (True, 2, "aic=True must be a positive int"),
    (8.0, 16, "aic=8.0 must be a positive int"),
])
def test_limit_core_validation(aic, aiv, needle):
    with pytest.raises(PlatformError, match="^limit_core: ") as e:
        CPU.limit_core(aic, aiv)
    assert needle in str(e.value)


@pytest.mark.parametrize("device,needle", [("npu", "torch_npu"), ("npu:0", "torch_npu"), ("tpu", "npu:I"),
                                           ("cuda:1", "no CUDA")])
def test_launch_pd_bad_device_exits_2(device, needle):
    r = subprocess.run([sys.executable, "-m", "server.launch.cli", "--role", "prefill",
                        "--config", "configs/tiny-flash.yaml", "--device", device], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("launch-pd: --device:") and needle in r.stderr and "Traceback" not in r.stderr


def test_launch_pd_local_checks_the_device_form_first():
    r = subprocess.run([sys.executable, "-m", "server.launch.cli", "--role", "local",
                        "--config", "configs/tiny-flash.yaml", "--device", "gpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("launch-pd: --device: 'gpu' is not a device"), r.stderr


@pytest.mark.parametrize("role", ["prefill", "local"])
def test_launch_pd_device_from_the_environment_names_the_variable(role):
    import os
    env = {**os.environ, "DSV4_DEVICE": "tpu"}
    r = subprocess.run([sys.executable, "-m", "server.launch.cli", "--role", role,
                        "--config", "configs/tiny-flash.yaml"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and r.stderr.startswith("launch-pd: DSV4_DEVICE: 'tpu' is not a device"), r.stderr
