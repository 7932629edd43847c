"""A request's decode state as named tensors: what a prefill worker ships to a decode worker.

The names, shapes and dtypes are reference/dsv4-architecture.md §4's (no padding, no null
blocks); ``state_tensors`` exports them from the pools, ``load_state_tensors`` imports them. KV
and indexer keys travel as stored (``engine.ops.cache_codec``): a quantised cache ships its bytes
and scales, a cache with two parts (the int8 / fp8 indexer: values and a per-row scale) as
``<name>`` and ``<name>.scale``.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from engine.config import CSA_RATIO
from engine.core.block_manager import SeqBlocks
from engine.core.paged_state import PagedSequenceState

if TYPE_CHECKING:
    from engine.core.kv_cache import PagedCache


# ---- a request's state as named tensors (what P ships to D, reference §4) ----------------------
def state_tensors(cache: "PagedCache", held: SeqBlocks, num_tokens: int, layers: Iterable[int] | None = None
                  ) -> dict[str, torch.Tensor]:
    """The live decode state of the holding ``held`` after ``num_tokens`` (= L) tokens, no padding.

    Per layer l (rows as stored: ``expected_shapes`` gives each part's width and dtype):
    ``layers.l.win_kv`` ``min(L, W-1)`` rows (positions L-W+1 .. L-1: what step L reads); CSA /
    HCA ``layers.l.cmp_kv`` ``floor(L/m)`` rows; CSA ``layers.l.idx_kv`` ``floor(L/4)`` rows;
    compressor remainders ``layers.l.{comp,idx_comp}.{kv,score}``
    ``[L mod m, c*d]`` fp32 (score with ape added) and, once a CSA window has closed,
    ``...prev_kv`` / ``...prev_score`` ``[m, d]``. Returns copies (contiguous). ``layers``: only
    these layers (P/D pushes each layer as soon as its state is final).
    """
    st = PagedSequenceState(cache, held, num_tokens, layers)
    out: dict[str, torch.Tensor] = {}
    for l, layer in enumerate(st.layers):
        if layer is None:
            continue
        n = min(num_tokens, layer.window - 1)
        pos = torch.arange(num_tokens - n, num_tokens, device=layer.win_pool.device)
        out.update(layer_state_tensors(l, layer, layer.win_pool.gather(layer.ring_rows(pos)), num_tokens))
    return out


def layer_state_tensors(l: int, layer, win_kv: torch.Tensor, num_tokens: int) -> dict[str, torch.Tensor]:
    """Layer ``l``'s ``state_tensors`` entries from a ``PagedLayerState`` or a contiguous
    ``engine.model.state.LayerState`` (same attributes) after ``num_tokens`` tokens; ``win_kv``: its
    window rows as stored (the codec's parts), positions L-n .. L-1. Entries are ``stored()``
    results, remainders copies."""
    out = part_names(f"layers.{l}.win_kv", win_kv)
    for name in ("cmp_kv", "idx_kv"):
        ent = getattr(layer, name)
        if ent is not None:
            out.update(part_names(f"layers.{l}.{name}", ent.stored()))
    for name in ("comp", "idx_comp"):
        comp = getattr(layer, name)
        if comp is None:
            continue
        m = comp.kv.shape[0]
        out[f"layers.{l}.{name}.kv"] = comp.kv[: num_tokens % m].clone()
        out[f"layers.{l}.{name}.score"] = comp.score[: num_tokens % m].clone()
        if comp.prev_kv is not None and num_tokens >= m:
            out[f"layers.{l}.{name}.prev_kv"] = comp.prev_kv.clone()
            out[f"layers.{l}.{name}.prev_score"] = comp.prev_score.clone()
    return out


def part_name(name: str, i: int) -> str:
    """Transfer name of a cache's stored part ``i``: ``name``, then ``name.scale``."""
    return name if i == 0 else f"{name}.scale"


def part_names(name: str, parts) -> dict[str, torch.Tensor]:
    """A cache's stored parts under their transfer names (``part_name``)."""
    return {part_name(name, i): p for i, p in enumerate(parts)}


def expected_shapes(cache: "PagedCache", num_tokens: int, layers: Iterable[int] | None = None
                    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) that ``state_tensors`` gives for L = ``num_tokens`` on this model
    (``cache``: anything with ``args``, ``geometry``, ``kv_codec`` and ``idx_codec``)."""
    a, L = cache.args, num_tokens
    d, dI = a.head_dim, a.index_head_dim
    out = {}

    def rows(name: str, codec, n: int) -> None:
        for i, shape_dtype in enumerate(codec.part_shapes(n)):
            out[part_name(name, i)] = shape_dtype

    for l in (range(cache.geometry.num_layers) if layers is None else layers):
        rows(f"layers.{l}.win_kv", cache.kv_codec, min(L, a.sliding_window - 1))
        m = a.compress_ratios[l]
        if not m:
            continue
        rows(f"layers.{l}.cmp_kv", cache.kv_codec, L // m)
        comps = [("comp", d)] + ([("idx_comp", dI)] if m == CSA_RATIO else [])
        if m == CSA_RATIO:
            rows(f"layers.{l}.idx_kv", cache.idx_codec, L // m)
        for name, w in comps:
            width = 2 * w if m == CSA_RATIO else w
            out[f"layers.{l}.{name}.kv"] = ((L % m, width), torch.float32)
            out[f"layers.{l}.{name}.score"] = ((L % m, width), torch.float32)
            if m == CSA_RATIO and L >= m:
                out[f"layers.{l}.{name}.prev_kv"] = ((m, w), torch.float32)
                out[f"layers.{l}.{name}.prev_score"] = ((m, w), torch.float32)
    return out


def check_state_tensors(cache, num_tokens: int, tensors: dict[str, torch.Tensor],
                        layers: Iterable[int] | None = None) -> list[int] | None:
    """Check ``tensors`` against ``expected_shapes`` for L = ``num_tokens`` (``cache``: anything
    with ``args``, ``geometry``, ``kv_codec`` and ``idx_codec``, e.g. a ``PagedCache``). Returns ``layers`` sorted
    and deduplicated (None: all).

    Raises:
        ValueError: a layer out of range, a missing / extra tensor, a value that is not a tensor,
            or another shape / dtype.
    """
    if layers is not None:
        layers = sorted(set(layers))
        if any(not 0 <= l < cache.geometry.num_layers for l in layers):
            raise ValueError(f"layers {layers}: the model has {cache.geometry.num_layers}")
    want = expected_shapes(cache, num_tokens, layers)
    if set(tensors) != set(want):
        missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
        raise ValueError(f"state for L={num_tokens}: missing {missing[:4]}, unexpected {extra[:4]}")
    for k, (shape, dtype) in want.items():
        t = tensors[k]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"state tensor {k}: a {type(t).__name__}, not a torch.Tensor")
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"state tensor {k}: expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    return layers


def load_state_tensors(cache: "PagedCache", held: SeqBlocks, num_tokens: int, tensors: dict[str, torch.Tensor],
                       layers: Iterable[int] | None = None) -> None:
    """Write ``state_tensors`` output into the holding ``held`` (already allocated, freshly reset);
    ``layers``: only these layers (each written once).

    Raises:
        ValueError: as ``check_state_tensors`` (nothing is half-written: everything is checked
            before the first write).
    """
    layers = check_state_tensors(cache, num_tokens, tensors, layers)
    st = PagedSequenceState(cache, held, 0, layers)
    for l, layer in enumerate(st.layers):
        if layer is None:
            continue
        win = _parts(tensors, f"layers.{l}.win_kv")
        pos = torch.arange(num_tokens - win[0].shape[0], num_tokens, device=layer.win_pool.device)
        layer.win_pool.scatter(layer.ring_rows(pos), win)
        for name in ("cmp_kv", "idx_kv"):
            ent = getattr(layer, name)
            if ent is not None:
                ent.append_stored(_parts(tensors, f"layers.{l}.{name}"))
        for name in ("comp", "idx_comp"):
            comp = getattr(layer, name)
            if comp is None:
                continue
            r = num_tokens % comp.kv.shape[0]
            comp.kv[:r] = tensors[f"layers.{l}.{name}.kv"]
            comp.score[:r] = tensors[f"layers.{l}.{name}.score"]
            if f"layers.{l}.{name}.prev_kv" in tensors:
                comp.prev_kv.copy_(tensors[f"layers.{l}.{name}.prev_kv"])
                comp.prev_score.copy_(tensors[f"layers.{l}.{name}.prev_score"])


def sequence_state_tensors(st, num_tokens: int) -> dict[str, torch.Tensor]:
    """A contiguous ``SequenceState`` after ``num_tokens`` tokens as ``cache.state_tensors`` names
    (what ``load_state_tensors`` writes into paged pools; reference §4)."""
    out = {}
    for l, layer in enumerate(st.layers):
        W = layer.win_kv.num_rows
        n = min(num_tokens, W - 1)
        win = layer.win_kv.gather(torch.arange(num_tokens - n, num_tokens, device=layer.win_kv.device) % W)
        out.update(layer_state_tensors(l, layer, win, num_tokens))
    return out


# ---- the MTP layers' window rings (next_n > 0): final only after the step that drafts ----------
def mtp_state_tensors(cache: "PagedCache", held: SeqBlocks, num_tokens: int) -> dict[str, torch.Tensor]:
    """``mtp.k.win_kv``: MTP layer k's ring rows of positions L-n .. L-1, n = min(L, W-1), as
    stored (what the first verify step's MTP catch-up reads). Empty without MTP pools."""
    out: dict[str, torch.Tensor] = {}
    for k in range(len(cache.mtp_win)):
        st = cache.mtp_state(held, num_tokens, k)
        pos = torch.arange(num_tokens - min(num_tokens, st.window - 1), num_tokens, device=st.win_pool.device)
        out.update(part_names(f"mtp.{k}.win_kv", st.win_pool.gather(st.ring_rows(pos))))
    return out


def load_mtp_state_tensors(cache: "PagedCache", held: SeqBlocks | None, num_tokens: int,
                           tensors: dict[str, torch.Tensor], check_only: bool = False) -> None:
    """Write ``mtp_state_tensors`` output into ``held``'s MTP rings (``check_only``: only raise
    what writing would).

    Raises:
        ValueError: names, shapes or dtypes other than this cache's MTP rings take (nothing written).
    """
    n = min(num_tokens, cache.args.sliding_window - 1)
    want = {part_name(f"mtp.{k}.win_kv", i): sd for k in range(len(cache.mtp_win))
            for i, sd in enumerate(cache.kv_codec.part_shapes(n))}
    if set(tensors) != set(want):
        raise ValueError(f"MTP state for L={num_tokens}: expected {sorted(want)}, got {sorted(tensors)}")
    for name, (shape, dtype) in want.items():
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"state tensor {name}: a {type(t).__name__}, not a torch.Tensor")
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"state tensor {name}: expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    if check_only:
        return
    for k in range(len(cache.mtp_win)):
        st = cache.mtp_state(held, num_tokens, k)
        pos = torch.arange(num_tokens - n, num_tokens, device=st.win_pool.device)
        st.win_pool.scatter(st.ring_rows(pos), _parts(tensors, f"mtp.{k}.win_kv"))


def _parts(tensors: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in (tensors[name], tensors.get(part_name(name, 1))) if t is not None)


def load_split(cache: "PagedCache", held: SeqBlocks | None, num_tokens: int, tensors: dict[str, torch.Tensor],
               layers: list[int] | None = None, check_only: bool = False) -> None:
    """``load_state_tensors`` for the trunk's names and ``load_mtp_state_tensors`` for ``mtp.*``
    (a call with only MTP rings writes no trunk layer), both checked before either writes.
    ``check_only``: raise what writing would (ValueError), write nothing (``held`` may be None)."""
    mtp = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    trunk = {k: v for k, v in tensors.items() if k not in mtp}
    if trunk or not mtp:
        check_state_tensors(cache, num_tokens, trunk, layers)
    if mtp:
        load_mtp_state_tensors(cache, held, num_tokens, mtp, check_only=True)
    if check_only:
        return
    if trunk or not mtp:
        load_state_tensors(cache, held, num_tokens, trunk, layers)
    if mtp:
        load_mtp_state_tensors(cache, held, num_tokens, mtp)
