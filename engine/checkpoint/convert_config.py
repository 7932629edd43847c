"""``dsv4-convert-config``: rewrite config.json's quantisation section as upstream ``convert_config.py`` (reference §1.3).

For the original Hybrid FP8-MXFP4 weights, which it does not touch: the ``fp8`` quantization_config
becomes a compressed-tensors one (Linear: FP8 128x128 block weights, FP8 1x128 activations;
MoEGMM: MXFP4 weights, MXFP8 activations; FP8 KV / indexer caches; ``ignore`` = the bf16
compressor / indexer linears and the heads). ``--hif`` writes the HiF8 variant. The original is
kept as ``config.json.bak`` unless ``--no-backup``; the rewrite is atomic (temp file + rename).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from engine.checkpoint.qscheme import compressed_tensors_config
from engine.config import ConfigError, ModelArgs, read_json_object

BACKUP = "config.json.bak"


def convert_config(ckpt: str | Path, hif: bool = False, backup: bool = True) -> Path:
    """Rewrite ``ckpt/config.json`` in place; returns its path.

    Raises:
        ConfigError: no config.json, an invalid one, or one that is not the original FP8 config
            (already converted, or unquantised). OSError: it cannot be written.
    """
    path = Path(ckpt) / "config.json"
    if not path.is_file():
        raise ConfigError(f"--input-fp8-hf-path {ckpt}: no config.json there")
    raw = read_json_object(path, ConfigError)
    args = ModelArgs.from_dict(raw)
    qc = raw.get("quantization_config")
    if args.quant is None or not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        found = qc.get("quant_method") if isinstance(qc, dict) else None
        raise ConfigError(f"--input-fp8-hf-path {ckpt}: config.json quantization_config.quant_method is "
                          f"{found!r}; only the original 'fp8' (Hybrid FP8-MXFP4) config is converted")
    new = {**raw, "quantization_config": compressed_tensors_config(
        args.num_hidden_layers, list(args.compress_ratios), None, hif=hif)}
    ModelArgs.from_dict(new)                             # the result must read back
    if backup and not (path.parent / BACKUP).exists():
        shutil.copy2(path, path.parent / BACKUP)
    tmp = path.with_name("config.json.tmp")
    tmp.write_text(json.dumps(new, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsv4-convert-config", description=__doc__.splitlines()[0])
    p.add_argument("--input-fp8-hf-path", required=True, help="original FP8-MXFP4 checkpoint directory")
    p.add_argument("--hif", action="store_true", help="the HiF8 variant (per-channel Linear weights, "
                   "per-tensor activations; compressor / indexer linears quantised)")
    p.add_argument("--no-backup", action="store_true", help=f"do not keep the original as {BACKUP}")
    a = p.parse_args(argv)
    try:
        path = convert_config(a.input_fp8_hf_path, hif=a.hif, backup=not a.no_backup)
    except ConfigError as e:
        print(f"dsv4-convert-config: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"dsv4-convert-config: error: --input-fp8-hf-path {a.input_fp8_hf_path}: cannot write "
              f"config.json ({e.strerror or e})", file=sys.stderr)
        return 2
    print(f"rewrote {path} (compressed-tensors{', HiF8' if a.hif else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
