"""Accuracy cost of quantised decode-state caches (issue 23): teacher-forced logits of a model
with each ``scheduler_config.kv_cache_dtype`` against the same model with unquantised caches.

``accuracy`` measures one model and cache; ``cache_accuracy`` writes the tiny flash / pro
checkpoints (``dsv4-make-tiny``, seed 1) to a temporary folder and measures every setting on both,
for ``bench/bench_cache_dtype.py``.
"""
from __future__ import annotations

import tempfile

import torch

from engine.cache_dtype import CacheDtype, resolve


def accuracy(model, cache: CacheDtype, positions: int = 320, seed: int = 0) -> dict[str, float]:
    """Teacher-forced over ``positions`` random tokens (one forward over a contiguous state):
    ``top1`` = share of positions whose argmax agrees with unquantised caches, ``mean_rel`` /
    ``max_rel`` = mean / max over positions of ``|z_q - z|_2 / |z|_2`` (logit vectors)."""
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(2, model.args.vocab_size, (positions,), generator=g)
    with torch.no_grad():
        ref = model.logits(model.forward(toks, model.new_state())).float()
        got = model.logits(model.forward(toks, model.new_state(cache=cache))).float()
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    return {"top1": float((got.argmax(-1) == ref.argmax(-1)).float().mean()), "mean_rel": float(rel.mean()),
            "max_rel": float(rel.max())}


def cache_accuracy(settings: list[str], presets: tuple[str, ...] = ("flash", "pro"),
                   positions: int = 320) -> dict[str, dict[str, float]]:
    """{setting: {"<preset> top1" | "<preset> mean_rel" | "<preset> max_rel": value}} on the tiny
    checkpoints (seed 1, fp32); ``settings`` as ``scheduler_config.kv_cache_dtype`` takes them."""
    from engine.checkpoint.loader import load_model
    from engine.checkpoint.make_tiny import make_tiny
    out: dict[str, dict[str, float]] = {s: {} for s in settings}
    with tempfile.TemporaryDirectory(prefix="dsv4-cache-acc-") as tmp:
        for preset in presets:
            model = load_model(make_tiny(preset, 1, f"{tmp}/{preset}"), progress=False)
            for s in settings:
                for k, v in accuracy(model, resolve(s, None), positions).items():
                    out[s][f"{preset} {k}"] = v
            del model
    return out
