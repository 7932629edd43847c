"""Checkpoint loading: validate the stored layout, then fill the model with the stored tensors as they are.

Before any weight is read, the shard headers are checked against the layout config.json implies
(``engine.checkpoint.shards``). The model is built on the meta device, every parameter is given
its stored dtype and shape (FP8 + e8m0 block scales, MXFP4 experts, the converted int8 / int4 /
MXFP8 / MXFP4 / HiF8 layouts of reference §7, bf16 / fp32 tensors as stored: resident bytes are
the stored bytes), a ``shard`` function may cut it for one rank, and then each kept tensor (or
slice) is copied once from the memory-mapped shard into its destination on the target device,
several at a time (a thread pool; ``Tensor.copy_`` releases the GIL). Quantised linears and experts
carry ``fmt`` (``engine.ops.packed``) and run through ``ops.quant_linear`` / ``ops.moe_experts``;
``packed=False`` dequantises them once into dense compute-dtype weights instead (the dequantised
reference path the numerics tests compare against). Problems raise
``engine.checkpoint.shards.CheckpointError``.
"""
from __future__ import annotations

import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from engine.checkpoint.formats import stored_args
from engine.checkpoint.layout import checkpoint_layout, model_linears
from engine.checkpoint.mapped import TORCH_DTYPES, MappedShards
from engine.checkpoint.qscheme import ACT_SCHEME
from engine.checkpoint.shards import CheckpointError, StoredTensor, scan_checkpoint, validate_layout
from engine.checkpoint.values import check_int4_bias, check_values
from engine.config import ModelArgs
from engine.model.layers import deferred_params
from engine.model.moe import Experts
from engine.model.transformer import Transformer
from engine.ops import REFERENCE, Ops
from engine.ops.packed import dequant

log = logging.getLogger(__name__)
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.(weight|scale|bias)$")
PROGRESS_EVERY_S = 5.0
COPY_CHUNK_BYTES = 64 << 20        # a large tensor is checked, copied and unmapped this much at a time


def narrow_cuts(t: torch.Tensor, cuts: tuple) -> torch.Tensor:
    """``t`` narrowed along each (dim, first, length) of ``cuts`` (a view)."""
    for d, lo, n in cuts:
        t = t.narrow(d, lo, n)
    return t


def param_of(name: str) -> tuple[str, str, int | None]:
    """Checkpoint tensor ``name`` -> (module path, attribute, expert index or None). Routed experts
    are stacked: ``P.experts.{e}.w1.weight`` / ``.scale`` / ``.bias`` -> ``P.experts`` ``w1`` /
    ``w1_scale`` / ``w1_bias`` [e]; every other name is ``module path . attribute``."""
    m = _EXPERT.match(name)
    if m:
        prefix, e, w, part = m.groups()
        return prefix, (w if part == "weight" else f"{w}_{part}"), int(e)
    mod, _, attr = name.rpartition(".")
    return mod, attr, None


def _set(module: nn.Module, attr: str, t: torch.Tensor, like: torch.Tensor | None = None) -> None:
    """Put ``t`` in ``module`` as parameter / buffer ``attr`` (keeping ``like``'s ``shard_cuts``)."""
    if attr in module._buffers:
        module._buffers[attr] = t
        return
    p = nn.Parameter(t, requires_grad=False)
    if like is not None and hasattr(like, "shard_cuts"):
        p.shard_cuts = like.shard_cuts
    module._parameters[attr] = p


def _to_stored(model: Transformer, args: ModelArgs, found: dict[str, StoredTensor]) -> None:
    """Give every parameter (on meta) the dtype and shape of what the checkpoint stores for it,
    and set ``fmt`` / ``act`` / ``block`` on the quantised linears and experts."""
    seen = set()
    for name, t in found.items():
        mod, attr, e = param_of(name)
        if (mod, attr) in seen:
            continue
        seen.add((mod, attr))
        shape = t.shape if e is None else (args.n_routed_experts, *t.shape)
        _set(model.get_submodule(mod), attr, torch.empty(shape, dtype=TORCH_DTYPES[t.dtype], device="meta"))
    block = tuple(args.quant.weight_block_size) if args.quant else (128, 128)
    for name, lin in model_linears(args).items():
        if f"{name}.weight" not in found:                     # a skipped MTP block
            continue
        fmt, act = (None if lin.kind == "bf16" else lin.kind), ACT_SCHEME[lin.kind]
        module = model.get_submodule(name.rsplit(".", 2)[0] if ".experts." in name else name)
        if fmt is not None or act is not None:
            module.fmt, module.act, module.block = fmt, act, block


def _jobs(model: Transformer, found: dict[str, StoredTensor]) -> list[tuple]:
    """One job per destination tensor: (module, attr, [(checkpoint name, cuts, index in dst)], bytes).

    A sharded parameter's ``shard_cuts`` name the slice it keeps (in stored coordinates); a stacked
    expert tensor keeps the experts of its dim-0 cut and reads only theirs."""
    names: dict[tuple[str, str], list[tuple[str, int | None]]] = {}
    for name in found:
        mod, attr, e = param_of(name)
        names.setdefault((mod, attr), []).append((name, e))
    jobs = []
    for (mod, attr), srcs in names.items():
        module = model.get_submodule(mod)
        p = getattr(module, attr)
        cuts = tuple(getattr(p, "shard_cuts", ()))
        if srcs[0][1] is None:
            sources = [(srcs[0][0], cuts, None)]
        else:
            lo, n = next(((lo, n) for d, lo, n in cuts if d == 0), (0, p.shape[0]))
            rest = tuple((d - 1, a, b) for d, a, b in cuts if d != 0)
            sources = [(nm, rest, e - lo) for nm, e in srcs if lo <= e < lo + n]
        jobs.append((module, attr, sources, p.numel() * p.element_size()))
    return sorted(jobs, key=lambda j: -j[3])


def _fill(job: tuple, views: MappedShards, device: torch.device, args: ModelArgs) -> torch.Tensor:
    """Copy one job's sources into a new tensor on ``device`` (checked where cheap)."""
    module, attr, sources, _ = job
    p = getattr(module, attr)
    dst = torch.empty(p.shape, dtype=p.dtype, device=device)
    for name, cuts, idx in sources:
        whole = views.view(name)
        src = narrow_cuts(whole, cuts)
        d = dst if idx is None else dst[idx]
        if tuple(src.shape) != tuple(d.shape):                 # a padded shard (LM head): rows past the slice are 0
            d.zero_()
            d = d[tuple(slice(0, n) for n in src.shape)]
        row = src[0].numel() * src.element_size() if src.dim() and len(src) else 0
        step = max(1, COPY_CHUNK_BYTES // row) if row and src.is_contiguous() else max(len(src), 1) if src.dim() else 1
        for r in range(0, len(src) if src.dim() else 1, step):       # bounded transients: checks, mapped pages
            part = src[r:r + step] if src.dim() else src
            check_values(name, part, args)
            (d[r:r + step] if src.dim() else d).copy_(part)
            if step < len(src):
                views.release(name, part.data_ptr() - whole.data_ptr(), part.numel() * part.element_size())
        del src, whole
        views.release(name)
    return dst


def _read_all(model: Transformer, jobs: list[tuple], views: MappedShards, device, args: ModelArgs,
              threads: int, progress: bool) -> None:
    total = sum(j[3] for j in jobs)
    bar = tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, disable=not progress)
    t0 = last = time.monotonic()
    done = 0
    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = {pool.submit(_fill, job, views, device, args): job for job in jobs}
        try:
            for fut in as_completed(futures):
                module, attr, _, nbytes = job = futures[fut]
                _set(module, attr, fut.result(), getattr(module, attr))
                done += nbytes
                bar.update(nbytes)
                now = time.monotonic()
                if now - last >= PROGRESS_EVERY_S:
                    last = now
                    log.info("loading weights: %.2f / %.2f GB (%d%%), %.0f MB/s", done / 1e9, total / 1e9,
                             100 * done // max(total, 1), done / 1e6 / (now - t0))
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    bar.close()
    dt = time.monotonic() - t0
    log.info("loaded %.2f GB of weights in %.1f s (%.0f MB/s, %d threads)", total / 1e9, dt, total / 1e6 / max(dt, 1e-9),
             threads)


def densify(model: Transformer) -> None:
    """Dequantise every quantised linear / expert stack once into a dense weight of its
    ``compute_dtype`` (the dequantised reference path; memory as the dense model)."""
    for mod in model.modules():
        if getattr(mod, "fmt", None) is None:
            continue
        if isinstance(mod, Experts):
            for w, p in zip(("w1", "w3", "w2"), mod.stored()):
                _set(mod, w, dequant(p, mod.compute_dtype), getattr(mod, w))
                for part in ("scale", "bias"):
                    mod._parameters[f"{w}_{part}"] = None
        else:
            _set(mod, "weight", dequant(mod.packed, mod.compute_dtype), mod.weight)
            mod._parameters["scale"] = mod._parameters["bias"] = None
        mod.fmt = None


def load_model(ckpt_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               ops: Ops = REFERENCE, progress: bool = True, packed: bool = True,
               shard: Callable[[Transformer], object] | None = None, mtp: bool = False,
               threads: int | None = None, num_layers: int | None = None,
               max_position_embeddings: int | None = None) -> Transformer:
    """Read config.json, validate the shards, and return a filled ``Transformer``.

    Args:
        ckpt_dir: checkpoint directory in the original DeepSeek-V4 layout or a converted one (§7).
        dtype: compute dtype, ``torch.float32`` or ``torch.bfloat16``.
        device: where the parameters are created and filled (no host copy of the model).
        progress: show a tqdm bar (stderr); a log line with bytes/s is written either way.
        packed: keep quantised weights as stored (default); False dequantises them once into
            dense compute-dtype weights (the reference the numerics tests compare with).
        shard: cuts the model before any weight is read (e.g. ``engine.parallel.shard.
            apply_parallel`` for one rank): it gets the model with meta parameters in their stored
            dtypes / shapes (``fmt`` / ``act`` set); a rank then reads only the slices it keeps
            (``shard_cuts``) and never another EP shard's experts.
        mtp: load the MTP block (``mtp.*``); without it ``model.mtp`` is empty.
        threads: tensors copied at once (default: the CPU count, at most 8).
        num_layers / max_position_embeddings: ``model_config.custom_params``' overrides
            (``ModelArgs.overridden``): a reduced-layer run reads only the first ``num_layers``
            backbone layers' tensors; the checkpoint is still validated whole.
    Raises:
        ConfigError: bad config.json, or raised by ``shard``. CheckpointError: layout or value
            problems (one line each).
    """
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint: directory {ckpt} does not exist")
    found = scan_checkpoint(ckpt)
    args = stored_args(ModelArgs.from_json(ckpt), found)
    validate_layout(checkpoint_layout(args), found)
    full = args.num_hidden_layers
    args = args.overridden(num_layers, max_position_embeddings)
    dropped = tuple(f"layers.{i}." for i in range(args.num_hidden_layers, full))
    keep = {n: t for n, t in found.items() if (mtp or not n.startswith("mtp.")) and not n.startswith(dropped)}
    with deferred_params():
        model = Transformer(args, dtype, ops)
    if not mtp:
        model.mtp = nn.ModuleList()
    _to_stored(model, args, keep)
    if shard is not None:
        shard(model)
    device = torch.device(device)
    with MappedShards(ckpt, keep) as views, torch.no_grad():
        _read_all(model, _jobs(model, keep), views, device, args, threads or min(8, os.cpu_count() or 1), progress)
    empty = next((n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if empty is not None:
        raise CheckpointError(f"checkpoint: no stored tensor fills model tensor '{empty}'")
    check_int4_bias(model)
    if not packed:
        densify(model)
    return model.to(device).train(False)
