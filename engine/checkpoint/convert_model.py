"""``dsv4-convert-model``: the original FP8-MXFP4 checkpoint -> W8A8 / W4A8 int or MX / HiF8 (reference §7).

Shard by shard, as upstream ``utils/convert_model.py``: each tensor of an input shard goes to the
output shard of the same name; a linear is dequantised (FP8 block / MXFP4 -> bf16, exact) and
re-encoded in the format ``engine.checkpoint.qscheme.linear_format`` names; everything else is copied.

Safety:
* every input problem (unknown type, bad config, missing shard, wrong dtype or shape, missing
  clip-factor file) is found before anything is written;
* the output is built in a hidden sibling ``.<out>.partial`` directory and renamed to ``out`` only
  after the whole result validates, so ``out`` is complete or absent;
* an interrupted run (Ctrl-C, kill) leaves the partial directory and its ``convert_state.json``;
  the same command resumes after the last finished shard;
* memory: input tensors are read one at a time and one output shard is held, so the peak is about
  two shards (``tests/engine/checkpoint/convert/test_robustness.py`` measures it).
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from engine.checkpoint.fp8_mxfp4 import QuantFormatError
from engine.checkpoint.hif8 import hif8_quant_per_channel
from engine.checkpoint.int8_int4 import int4_bias, pack_int4_rows, quant_int4, quant_int8, scale_to_u64
from engine.checkpoint.layout import LinearSpec, checkpoint_layout, model_linears
from engine.checkpoint.formats import dequant_linear, stored_args
from engine.checkpoint.mx import quant_mx
from engine.checkpoint.qscheme import QUANT_TYPES, compressed_tensors_config, linear_format
from engine.checkpoint.shards import (DTYPE_BYTES, INDEX_FILE, CheckpointError, ShardReader, StoredTensor,
                                      read_shard_header, scan_checkpoint, validate_layout)
from engine.config import ConfigError, ModelArgs, read_json_object

STATE_FILE = "convert_state.json"
_NOT_COPIED = {"config.json", INDEX_FILE, "config.json.bak"}


class ConvertError(ValueError):
    """Bad input to the converter; the message names the flag or file."""


def encode(w: torch.Tensor, fmt: str, clip=None) -> dict[str, torch.Tensor]:
    """Dense ``[N, K]`` -> the stored tensors of format ``fmt`` (suffix -> tensor; the codecs are
    ``engine.checkpoint.int8_int4``, ``engine.checkpoint.mx`` and ``engine.checkpoint.hif8``)."""
    if fmt == "bf16":
        return {"weight": w.to(torch.bfloat16)}
    if fmt == "int8":
        q, s = quant_int8(w, clip)
        return {"weight": q, "scale": s}
    if fmt == "int4":
        q, s = quant_int4(w, clip)
        return {"weight": pack_int4_rows(q), "scale": scale_to_u64(s), "bias": int4_bias(q, s)}
    if fmt in ("mxfp8", "mxfp4"):
        q, s = quant_mx(w, 8 if fmt == "mxfp8" else 4)
        return {"weight": q, "scale": s}
    if fmt == "hif8":
        q, s = hif8_quant_per_channel(w)
        return {"weight": q, "scale": s}
    raise QuantFormatError(f"unknown format {fmt!r}")


def load_clip_params(path: Path, num_layers: int) -> dict[str, torch.Tensor]:
    """Upstream's ``quant_params_{layer}.pt`` files: ``{linear}.clip_factor_min/max`` tensors.

    Raises:
        ConvertError: a missing, unreadable or malformed file (named).
    """
    if not path.is_dir():
        raise ConvertError(f"--quant-param-path {path}: not a directory")
    out: dict[str, torch.Tensor] = {}
    missing = [f"quant_params_{i}.pt" for i in range(num_layers) if not (path / f"quant_params_{i}.pt").is_file()]
    if missing:
        raise ConvertError(f"--quant-param-path {path}: missing {', '.join(missing[:3])}"
                           f"{' ...' if len(missing) > 3 else ''} (one file per layer 0..{num_layers - 1})")
    for i in range(num_layers):
        f = path / f"quant_params_{i}.pt"
        try:
            d = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
            raise ConvertError(f"--quant-param-path: {f.name} cannot be read ({type(e).__name__}: {e})") from None
        if not isinstance(d, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in d.items()):
            raise ConvertError(f"--quant-param-path: {f.name} must hold a dict of name -> tensor")
        out.update(d)
    return out


def check_clip_params(params: dict[str, torch.Tensor], linears: dict[str, LinearSpec]) -> None:
    """Every entry names a linear of this model and holds 1 or ``out_features`` finite values > 0.

    Raises:
        ConvertError: the first bad entry (before anything is written).
    """
    unknown = sorted(k for k in params if k.rsplit(".", 1)[0] not in linears
                     or not k.endswith((".clip_factor_min", ".clip_factor_max")))
    if unknown:
        raise ConvertError(f"--quant-param-path: {len(unknown)} entries name no linear of this model, e.g. "
                           f"{unknown[0]!r} (expected '<linear>.clip_factor_min' / '.clip_factor_max')")
    for key, t in params.items():
        n = linears[key.rsplit(".", 1)[0]].out_features
        if t.numel() not in (1, n):
            raise ConvertError(f"--quant-param-path: {key} has {t.numel()} values, expected 1 or {n}")
        if not (torch.isfinite(t).all() and (t > 0).all()):
            raise ConvertError(f"--quant-param-path: {key} must be finite and > 0")


def _clip_for(params: dict[str, torch.Tensor] | None, name: str, n: int):
    """(min factors, max factors) ``[n, 1]`` fp32 for linear ``name``, or None."""
    if not params:
        return None
    lo, hi = params.get(f"{name}.clip_factor_min"), params.get(f"{name}.clip_factor_max")
    if lo is None and hi is None:
        return None
    return tuple(torch.ones(n, 1) if t is None else t.float().reshape(-1, 1).expand(n, 1) for t in (lo, hi))


def _fingerprint(src: Path, shards: list[str], quant_type: str, params: Path | None) -> str:
    h = hashlib.sha256((src / "config.json").read_bytes())
    for s in shards:
        st = (src / s).stat()
        h.update(f"{s}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(quant_type.encode())
    if params is not None:
        for f in sorted(params.glob("quant_params_*.pt")):
            h.update(f.name.encode() + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def _check_input(src: Path, quant_type: str) -> tuple[ModelArgs, dict[str, StoredTensor], dict]:
    if quant_type not in QUANT_TYPES:
        raise ConvertError(f"--quant-type {quant_type!r} is not one of {', '.join(QUANT_TYPES)}")
    if not src.is_dir():
        raise ConvertError(f"--input-fp8-hf-path {src}: not a directory")
    try:
        raw = read_json_object(src / "config.json", ConfigError)
        found = scan_checkpoint(src)
        args = stored_args(ModelArgs.from_dict(raw), found)
        if args.quant is None:
            raise ConvertError(f"--input-fp8-hf-path {src}: config.json has no quantization_config; the input "
                               "must be the original Hybrid FP8-MXFP4 checkpoint")
        if args.quant.quant_type is not None:
            raise ConvertError(f"--input-fp8-hf-path {src}: already converted ({args.quant.quant_type}); "
                               "convert the original FP8-MXFP4 checkpoint instead")
        validate_layout(checkpoint_layout(args), found)
    except (ConfigError, CheckpointError) as e:
        raise ConvertError(f"--input-fp8-hf-path {src}: {e}") from None
    return args, found, raw


def convert_model(src: str | Path, out: str | Path, quant_type: str, quant_param_path: str | Path | None = None,
                  progress: bool = True) -> Path:
    """Convert checkpoint ``src`` into ``out`` (must not exist, or be an empty directory).

    Raises:
        ConvertError: bad input (nothing written). OSError: the output cannot be written.
    """
    src, out = Path(src), Path(out).resolve()
    args, found, raw = _check_input(src, quant_type)
    params = None
    if quant_param_path is not None:
        if not quant_type.endswith("-int"):
            raise ConvertError(f"--quant-param-path: clip factors apply to the int types only, not {quant_type}")
        params = load_clip_params(Path(quant_param_path), args.num_hidden_layers)
        check_clip_params(params, model_linears(args))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"--output-hf-path {out} exists and is not an empty directory")
    shards = sorted({t.file for t in found.values()})
    fp = _fingerprint(src, shards, quant_type, Path(quant_param_path) if quant_param_path else None)
    part = out.parent / f".{out.name}.partial"
    state = _resume_state(part, fp)
    out_args = ModelArgs.from_dict({**raw, "quantization_config": compressed_tensors_config(
        args.num_hidden_layers, list(args.compress_ratios), quant_type)})
    expected = checkpoint_layout(out_args)
    linears = model_linears(args)
    _bound_heap()
    try:
        with ShardReader(src, found, max_open=1) as reader:
            bar = tqdm(shards, desc=f"converting to {quant_type}", unit="shard", disable=not progress)
            for shard in bar:
                if shard in state["done"]:
                    continue
                tensors = _convert_shard(shard, found, linears, args, quant_type, params, reader.get)
                _write_shard(part, shard, tensors, expected)
                del tensors
                _release_memory()
                state["done"].append(shard)
                _write_json(part / STATE_FILE, state)
            bar.close()
        if not state.get("finished"):
            _finish(src, part, raw, out_args, expected)
            state["finished"] = True
            _write_json(part / STATE_FILE, state)
    except ValueError:
        shutil.rmtree(part, ignore_errors=True)        # bad input: nothing worth resuming
        raise
    _publish(part, out)
    (out / STATE_FILE).unlink()
    return out


def _publish(part: Path, out: Path) -> None:
    """Rename the finished ``part`` to ``out`` (absent or an empty directory): one atomic rename,
    or, across filesystems (``out`` a mount point), its entries moved in one by one."""
    try:
        os.replace(part, out)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EBUSY) or not out.is_dir():
            raise
        for f in sorted(part.iterdir(), key=lambda f: f.name == STATE_FILE):   # the state file last
            shutil.move(str(f), str(out / f.name))
        part.rmdir()


def _libc(name: str, *args) -> None:
    """Call a glibc allocator knob; a no-op where it does not exist (musl, macOS)."""
    try:
        getattr(ctypes.CDLL(None), name)(*args)
    except (OSError, AttributeError):
        pass


def _bound_heap() -> None:
    """Fixed mmap threshold (glibc's M_MMAP_THRESHOLD = -3): glibc otherwise raises it after large
    frees, moving tensor temporaries onto the heap, where fragmentation holds several shards."""
    _libc("mallopt", -3, 128 << 10)


def _release_memory() -> None:
    """Hand the freed heap back to the OS between shards."""
    _libc("malloc_trim", 0)


def _resume_state(part: Path, fp: str) -> dict:
    """The partial directory's state if it belongs to this exact conversion, else a fresh one."""
    if part.exists():
        if not (part / STATE_FILE).is_file():
            raise ConvertError(f"--output-hf-path: {part} exists but is not a conversion in progress; remove it")
        try:
            state = json.loads((part / STATE_FILE).read_text())
            if state.get("fingerprint") == fp and all((part / s).is_file() for s in state["done"]):
                return state
        except (OSError, ValueError, KeyError, TypeError):
            pass
        shutil.rmtree(part)                            # another input, type or clip factors: start over
    part.mkdir(parents=True)
    state = {"fingerprint": fp, "done": []}
    _write_json(part / STATE_FILE, state)
    return state


def _convert_shard(shard, found, linears: dict[str, LinearSpec], args: ModelArgs, quant_type: str, params,
                   get) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    block = args.quant.weight_block_size
    for name in sorted(n for n, t in found.items() if t.file == shard):
        base, _, suffix = name.rpartition(".")
        lin = linears.get(base) if suffix in ("weight", "scale") else None
        if lin is None:
            out[name] = get(name)
            continue
        if suffix == "scale":
            continue                                   # re-derived with its weight
        fmt = linear_format(quant_type, base, lin.kind)
        if lin.kind == fmt == "bf16":
            out[name] = get(name)                      # router, head, compressors: unchanged
            continue
        try:
            w = dequant_linear(base, lin.kind, get, block).to(torch.bfloat16)
            if not torch.isfinite(w).all():
                raise QuantFormatError("holds NaN or inf values")
            clip = _clip_for(params, base, lin.out_features) if fmt in ("int8", "int4") else None
            enc = encode(w, fmt, clip)
        except (QuantFormatError, ValueError) as e:
            if isinstance(e, ConvertError):
                raise
            raise ConvertError(f"--input-fp8-hf-path: tensor '{name}': {e}") from None
        del w
        for suf, t in enc.items():
            if t.dtype in (torch.bfloat16, torch.float32) and not torch.isfinite(t).all():
                raise ConvertError(f"--input-fp8-hf-path: tensor '{name}' converts to NaN / inf values")
            out[f"{base}.{suf}"] = t.contiguous()
    return out


def _write_shard(part: Path, shard: str, tensors: dict[str, torch.Tensor], expected) -> None:
    """Write one shard (tmp + rename) and check its header against the converted layout."""
    tmp = part / f"{shard}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    for name, t in read_shard_header(tmp).items():
        spec = expected.get(name)
        if spec is None or (spec.dtype, spec.shape) != (t.dtype, t.shape):
            raise ConvertError(f"internal: converted tensor '{name}' is {t.dtype} {list(t.shape)}, layout "
                               f"expects {spec}")
    tmp.chmod(0o644)
    os.replace(tmp, part / shard)


def _finish(src: Path, part: Path, raw: dict, out_args: ModelArgs, expected) -> None:
    """Index, config, side files; then validate the whole output against the converted layout."""
    weight_map, total = {}, 0
    for shard in sorted(p.name for p in part.glob("*.safetensors")):
        for name, t in read_shard_header(part / shard).items():
            weight_map[name] = shard
            total += math.prod(t.shape) * DTYPE_BYTES[t.dtype]
    _write_json(part / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    _write_json(part / "config.json", {**raw, "quantization_config": out_args.quant.compressed})
    for f in src.rglob("*"):                          # tokenizer, generation config, encoding/*.py, ...
        rel = f.relative_to(src)
        top = len(rel.parts) == 1
        if not f.is_file() or any(p.startswith(".") for p in rel.parts) or f.suffix == ".safetensors" or \
                f.name in _NOT_COPIED or (not top and f.suffix not in (".py", ".json", ".jinja")):
            continue
        (part / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copy2(f, part / rel)
        except PermissionError:
            raise ConvertError(f"--input-fp8-hf-path: {rel} cannot be read") from None
    try:
        validate_layout(expected, scan_checkpoint(part))
    except CheckpointError as e:
        raise ConvertError(f"output verification failed: {e}") from None


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsv4-convert-model", description=__doc__.splitlines()[0])
    p.add_argument("--input-fp8-hf-path", required=True, help="original FP8-MXFP4 checkpoint directory")
    p.add_argument("--output-hf-path", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--quant-type", required=True, help=f"one of {', '.join(QUANT_TYPES)}")
    p.add_argument("--quant-param-path", default=None,
                   help="directory of quant_params_{layer}.pt clip factors (int types; optional)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    try:
        path = convert_model(a.input_fp8_hf_path, a.output_hf_path, a.quant_type, a.quant_param_path,
                             progress=not a.no_progress)
    except ValueError as e:
        print(f"dsv4-convert-model: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"dsv4-convert-model: error: --output-hf-path {a.output_hf_path}: cannot write there "
              f"({e.strerror or e}); finished shards are kept: run the same command again to resume",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dsv4-convert-model: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    print(f"wrote {a.quant_type} checkpoint to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
