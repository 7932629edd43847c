"""Bad input leaves nothing behind and says why; an interrupted or failed run resumes; the output's
paths and side files; converting holds about two shards in memory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint import convert_model as cm
from engine.config import ModelArgs
from engine.checkpoint.make_tiny import PRESETS, make_tensors, write_shards
from engine.checkpoint.shards import scan_checkpoint

from .common import _link_copy


def _assert_nothing_written(out: Path):
    assert not out.exists() and not (out.parent / f".{out.name}.partial").exists()


def _run(argv, capsys) -> tuple[int, str]:
    rc = cm.main(argv + ["--no-progress"])
    return rc, capsys.readouterr().err


def test_bad_inputs_give_a_clear_message_and_no_output(orig, converted, tmp_path, capsys):
    out = tmp_path / "out"
    rc, err = _run(["--input-fp8-hf-path", str(orig), "--output-hf-path", str(out), "--quant-type", "w4a4"], capsys)
    assert rc == 2 and "--quant-type 'w4a4' is not one of w8a8-int, w4a8-int, w4a8-mx, w4a8-mx-hif" in err
    _assert_nothing_written(out)

    missing = _link_copy(orig, tmp_path / "missing")
    (missing / "model-00002-of-00004.safetensors").unlink()
    rc, err = _run(["--input-fp8-hf-path", str(missing), "--output-hf-path", str(out), "--quant-type", "w8a8-int"],
                   capsys)
    assert rc == 2 and "shard model-00002-of-00004.safetensors named in model.safetensors.index.json is missing" in err
    _assert_nothing_written(out)

    wrong = _link_copy(orig, tmp_path / "wrong")
    shard = scan_checkpoint(orig)["layers.0.attn.wq_b.weight"].file
    sd = load_file(str(orig / shard))
    sd["layers.0.attn.wq_b.weight"] = sd["layers.0.attn.wq_b.weight"].float().to(torch.bfloat16)
    (wrong / shard).unlink()
    save_file(sd, str(wrong / shard))
    rc, err = _run(["--input-fp8-hf-path", str(wrong), "--output-hf-path", str(out), "--quant-type", "w8a8-int"],
                   capsys)
    assert rc == 2 and "tensor 'layers.0.attn.wq_b.weight' has dtype BF16, expected F8_E4M3" in err
    _assert_nothing_written(out)

    rc, err = _run(["--input-fp8-hf-path", str(converted["w8a8-int"]), "--output-hf-path", str(out),
                    "--quant-type", "w4a8-int"], capsys)
    assert rc == 2 and "already converted (w8a8-int)" in err
    _assert_nothing_written(out)

    params = tmp_path / "params"
    params.mkdir()
    torch.save({}, params / "quant_params_0.pt")
    rc, err = _run(["--input-fp8-hf-path", str(orig), "--output-hf-path", str(out), "--quant-type", "w4a8-int",
                    "--quant-param-path", str(params)], capsys)
    assert rc == 2 and "--quant-param-path" in err and "missing quant_params_1.pt" in err
    _assert_nothing_written(out)
    rc, err = _run(["--input-fp8-hf-path", str(orig), "--output-hf-path", str(out), "--quant-type", "w4a8-mx",
                    "--quant-param-path", str(params)], capsys)
    assert rc == 2 and "clip factors apply to the int types only" in err
    _assert_nothing_written(out)

    out.mkdir()
    (out / "keep").write_text("x")
    rc, err = _run(["--input-fp8-hf-path", str(orig), "--output-hf-path", str(out), "--quant-type", "w8a8-int"],
                   capsys)
    assert rc == 2 and "exists and is not an empty directory" in err and (out / "keep").read_text() == "x"


def test_interrupted_conversion_resumes_where_it_stopped(orig, tmp_path, monkeypatch):
    fresh = cm.convert_model(orig, tmp_path / "fresh", "w8a8-int", progress=False)
    out = tmp_path / "out"
    calls = []
    real = cm._write_shard

    def flaky(part, shard, tensors, expected):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(shard)
        real(part, shard, tensors, expected)

    monkeypatch.setattr(cm, "_write_shard", flaky)
    with pytest.raises(KeyboardInterrupt):
        cm.convert_model(orig, out, "w8a8-int", progress=False)
    part = tmp_path / ".out.partial"
    assert not out.exists() and json.loads((part / cm.STATE_FILE).read_text())["done"] == calls
    first = list(calls)
    calls.clear()
    monkeypatch.setattr(cm, "_write_shard", lambda *a: (calls.append(a[1]), real(*a)))
    cm.convert_model(orig, out, "w8a8-int", progress=False)
    assert calls and not set(calls) & set(first) and len(first) + len(calls) == 4
    assert not part.exists()
    for f in sorted(p.name for p in fresh.iterdir()):
        assert (out / f).read_bytes() == (fresh / f).read_bytes(), f
    # a partial directory of another conversion (other quant type) is discarded, not reused
    monkeypatch.setattr(cm, "_write_shard", flaky)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        cm.convert_model(orig, tmp_path / "again", "w8a8-int", progress=False)
    monkeypatch.setattr(cm, "_write_shard", real)
    again = cm.convert_model(orig, tmp_path / "again", "w4a8-mx", progress=False)
    assert ModelArgs.from_json(again).quant.quant_type == "w4a8-mx"


_MEM_SCRIPT = r"""
import json, sys
from pathlib import Path
from engine.checkpoint import convert_model as cm

def status(key):   # kB
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])

src, out = Path(sys.argv[1]), Path(sys.argv[2])
import torch                                        # warm up the kernels and libraries conversion uses
from safetensors.torch import load_file, save_file
w = torch.randn(64, 64)
for fmt in ("int8", "int4", "mxfp8", "mxfp4", "hif8"):
    cm.encode(w, fmt)
save_file({"w": w}, str(src.parent / "warm.safetensors")); load_file(str(src.parent / "warm.safetensors"))
open("/proc/self/clear_refs", "w").write("5")      # reset the peak (VmHWM) to the current RSS
base = status("VmRSS:")
cm.convert_model(src, out, "w8a8-int", progress=False)
print(json.dumps({"growth": (status("VmHWM:") - base) * 1024}))
"""


def test_conversion_peak_memory_is_about_two_shards(tmp_path):
    """A 10-layer, 96-expert checkpoint in 8 MiB shards: peak RSS growth while converting stays
    within the shard being built (held + its serialised copy) and the input shard(s) read,
    far below the checkpoint size."""
    src, out = tmp_path / "src", tmp_path / "out"
    raw = dict(PRESETS["flash"], vocab_size=4096, num_hidden_layers=10, n_routed_experts=96,
               compress_ratios=[0, 0] + [4, 128] * 4 + [0])
    src.mkdir()
    write_shards(make_tensors(ModelArgs.from_dict(raw), 0), src, 8 << 20)
    (src / "config.json").write_text(json.dumps(raw))
    r = subprocess.run([sys.executable, "-c", _MEM_SCRIPT, str(src), str(out)], capture_output=True, text=True,
                       timeout=600, cwd=Path(__file__).resolve().parents[4])
    assert r.returncode == 0, r.stderr
    growth = json.loads(r.stdout.strip().splitlines()[-1])["growth"]
    shard_in = max(p.stat().st_size for p in src.glob("*.safetensors"))
    shard_out = max(p.stat().st_size for p in out.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"peak RSS growth {growth / 2**20:.1f} MiB; largest input shard {shard_in / 2**20:.1f} MiB, "
          f"largest output shard {shard_out / 2**20:.1f} MiB, output total {total / 2**20:.1f} MiB")
    assert growth <= 2 * (shard_out + shard_in) + (16 << 20)      # + one tensor's working set
    assert growth < total / 2


def test_nan_weights_and_bad_clip_factors_are_refused(orig, tmp_path, capsys):
    out = tmp_path / "out"
    bad = _link_copy(orig, tmp_path / "nan")
    shard = scan_checkpoint(orig)["layers.0.attn.wq_b.weight"].file
    sd = load_file(str(orig / shard))
    w = sd["layers.0.attn.wq_b.weight"].view(torch.uint8).clone()
    w[0, 0] = 0x7F                                       # e4m3 NaN
    sd["layers.0.attn.wq_b.weight"] = w.view(torch.float8_e4m3fn)
    (bad / shard).unlink()
    save_file(sd, str(bad / shard))
    for qt in ("w8a8-int", "w4a8-mx-hif"):
        rc, err = _run(["--input-fp8-hf-path", str(bad), "--output-hf-path", str(out), "--quant-type", qt], capsys)
        assert rc == 2 and "tensor 'layers.0.attn.wq_b.weight': holds NaN or inf values" in err, err
        _assert_nothing_written(out)
    params = tmp_path / "params"
    params.mkdir()
    for factor, msg in ((float("nan"), "must be finite and > 0"), (0.0, "must be finite and > 0")):
        for i in range(ModelArgs.from_json(orig).num_hidden_layers):
            torch.save({"layers.0.attn.wq_b.clip_factor_max": torch.tensor(factor)} if i == 0 else {},
                       params / f"quant_params_{i}.pt")
        rc, err = _run(["--input-fp8-hf-path", str(orig), "--output-hf-path", str(out), "--quant-type", "w8a8-int",
                        "--quant-param-path", str(params)], capsys)
        assert rc == 2 and msg in err
        _assert_nothing_written(out)
    torch.save({"layers.0.attn.wq_b.clip_factor_min": torch.ones(3)}, params / "quant_params_0.pt")
    rc, err = _run(["--input-fp8-hf-path", str(orig), "--output-hf-path", str(out), "--quant-type", "w8a8-int",
                    "--quant-param-path", str(params)], capsys)
    assert rc == 2 and "layers.0.attn.wq_b.clip_factor_min has 3 values, expected 1 or 512" in err
    _assert_nothing_written(out)
    torch.save({"layers.99.attn.wq_b.clip_factor_max": torch.tensor(0.5)}, params / "quant_params_0.pt")
    rc, err = _run(["--input-fp8-hf-path", str(orig), "--output-hf-path", str(out), "--quant-type", "w8a8-int",
                    "--quant-param-path", str(params)], capsys)
    assert rc == 2 and "1 entries name no linear of this model, e.g. 'layers.99.attn.wq_b.clip_factor_max'" in err
    _assert_nothing_written(out)


def test_write_error_keeps_finished_shards_for_resume(orig, tmp_path, monkeypatch, capsys):
    real, calls = cm.save_file, []

    def full_disk(tensors, path, metadata=None):
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        calls.append(path)
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(cm, "save_file", full_disk)
    out = tmp_path / "out"
    argv = ["--input-fp8-hf-path", str(orig), "--output-hf-path", str(out), "--quant-type", "w8a8-int"]
    rc, err = _run(argv, capsys)
    assert rc == 2 and "No space left on device" in err and "run the same command again to resume" in err
    part = tmp_path / ".out.partial"
    assert len(json.loads((part / cm.STATE_FILE).read_text())["done"]) == 2 and not out.exists()
    monkeypatch.setattr(cm, "save_file", real)
    n = len(calls)
    monkeypatch.setattr(cm, "save_file", lambda t, p, metadata=None: (calls.append(p), real(t, p, metadata=metadata)))
    assert _run(argv, capsys)[0] == 0
    assert len(calls) - n == 2 and not part.exists() and ModelArgs.from_json(out).quant.quant_type == "w8a8-int"


def test_resume_restarts_when_the_clip_factors_change(orig, tmp_path, monkeypatch):
    params = tmp_path / "params"
    params.mkdir()
    n_layers = ModelArgs.from_json(orig).num_hidden_layers
    for i in range(n_layers):
        torch.save({"layers.0.attn.wq_b.clip_factor_max": torch.tensor(0.3)} if i == 0 else {},
                   params / f"quant_params_{i}.pt")
    real, calls = cm._write_shard, []

    def stop_after_one(part, shard, tensors, expected):
        if calls:
            raise KeyboardInterrupt
        calls.append(shard)
        real(part, shard, tensors, expected)

    monkeypatch.setattr(cm, "_write_shard", stop_after_one)
    with pytest.raises(KeyboardInterrupt):
        cm.convert_model(orig, tmp_path / "out", "w8a8-int", params, progress=False)
    torch.save({}, params / "quant_params_0.pt")           # other factors: nothing may be reused
    calls.clear()
    monkeypatch.setattr(cm, "_write_shard", lambda *a: (calls.append(a[1]), real(*a)))
    out = cm.convert_model(orig, tmp_path / "out", "w8a8-int", params, progress=False)
    assert len(calls) == 4
    fresh = cm.convert_model(orig, tmp_path / "fresh", "w8a8-int", progress=False)
    for f in sorted(p.name for p in fresh.glob("*.safetensors")):
        assert (out / f).read_bytes() == (fresh / f).read_bytes()


def test_output_paths_and_side_files(orig, tmp_path, monkeypatch):
    src = _link_copy(orig, tmp_path / "src")
    (src / "encoding").mkdir()
    (src / "encoding" / "encoding_dsv4.py").write_text("# chat encoding\n")
    (src / "encoding" / "notes.bin").write_bytes(b"x")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    out = cm.convert_model(src, ".", "w4a8-mx", progress=False)
    assert out == here and (here / "config.json").is_file() and not list(tmp_path.glob(".*partial"))
    assert (here / "encoding" / "encoding_dsv4.py").read_text() == "# chat encoding\n"
    assert not (here / "encoding" / "notes.bin").exists() and (here / "tokenizer.json").is_file()
    (tmp_path / ".o.partial").mkdir()
    with pytest.raises(cm.ConvertError, match="exists but is not a conversion in progress"):
        cm.convert_model(src, tmp_path / "o", "w4a8-mx", progress=False)


def test_a_failed_final_rename_resumes_without_reconverting(orig, tmp_path, monkeypatch, capsys):
    real_publish, real_write, calls = cm._publish, cm._write_shard, []

    def fail(part, out):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(cm, "_publish", fail)
    out = tmp_path / "out"
    argv = ["--input-fp8-hf-path", str(orig), "--output-hf-path", str(out), "--quant-type", "w8a8-int"]
    rc, err = _run(argv, capsys)
    assert rc == 2 and "resume" in err and not out.exists()
    monkeypatch.setattr(cm, "_publish", real_publish)
    monkeypatch.setattr(cm, "_write_shard", lambda *a: (calls.append(a[1]), real_write(*a)))
    assert _run(argv, capsys)[0] == 0
    assert calls == [] and not (out / cm.STATE_FILE).exists() and ModelArgs.from_json(out).quant.quant_type


def test_publish_into_a_mount_point_moves_the_entries(tmp_path, monkeypatch):
    part, out = tmp_path / ".out.partial", tmp_path / "out"
    part.mkdir()
    out.mkdir()
    (part / "a.json").write_text("1")
    (part / cm.STATE_FILE).write_text("{}")
    real = os.replace

    def exdev(a, b):
        if Path(a) == part:
            raise OSError(18, "Invalid cross-device link")
        return real(a, b)

    monkeypatch.setattr(cm.os, "replace", exdev)
    cm._publish(part, out)
    assert not part.exists() and (out / "a.json").read_text() == "1" and (out / cm.STATE_FILE).exists()
