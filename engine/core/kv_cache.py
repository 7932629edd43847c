"""The tensors of the paged decode-state pools (reference/dsv4-architecture.md §4).

``PagedCache`` owns the pool tensors that the block ids of a ``BlockManager``
(``engine.core.block_manager``: which blocks a request holds, torch-free) index, and applies the
``PoolOp`` s the accounting records; ``sequence_state`` gives the model its view of one request's
holdings (``engine.core.paged_state``). ``LocalCache`` is the two in one process with the ops
applied at once (tests, benchmarks, tools: no model runner).
"""
from __future__ import annotations

import math

import torch

from engine.cache_dtype import CacheDtype
from engine.config import CSA_RATIO, HCA_RATIO, ModelArgs
from engine.core.block_manager import GROWING, BlockManager, CacheConfig, Geometry, SeqBlocks, plan_cache, pool_bytes
from engine.core.paged_state import PagedLayerState, PagedSequenceState
from engine.core.step import PoolOp
from engine.ops.cache_codec import CacheRows, codecs_for


class PagedCache:
    """The preallocated pools of one worker: the tensors a ``BlockManager``'s block ids index.

    Pools (``d`` head_dim, ``dI`` index_head_dim; flat rows = block * block_size + offset), KV and
    indexer keys as ``CacheRows`` in ``config.cache_dtype``'s storage (``engine.ops.cache_codec``;
    read as rows of the compute dtype): win[l] ``(n_win + ring/bs) * bs`` rows of d (and with
    next_n > 0 mtp_win[k] alike for MTP layer k); cmp_kv[l]
    ``n_c4 * bs + 1`` (CSA) or ``n_c128 * bs + 1`` (HCA) rows of d; idx_kv[l] ``n_c4 * bs + 1``
    rows of dI; fp32 tensors comp_kv / comp_score[l]
      ``[S + 1, rows, c*d]`` fp32, idx_comp_kv / idx_comp_score[l] ``[S + 1, rows, 2*dI]`` fp32
      (CSA layers), views of ``comp_stacks`` (kind -> (compress ratio, (kv, score)
      ``[its layers, S + 1, rows, width]``)); S = ``config.num_slots`` (requests' and prefix-cache
      entries' slots).

    Past the managed blocks each pool has a scratch part no request ever holds, for fixed-shape
    (graph) decode: ``pad_slot`` (a state slot) and ``pad_win_blocks`` (a window ring) for the
    padding rows of a batch bucket, and ``trash_row`` (the last row of an entry pool), where a
    compressor whose window does not close this step writes its unused entry.
    """

    def __init__(self, args: ModelArgs, config: CacheConfig, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.args, self.config = args, config
        self.dtype, self.device, self.cache_dtype = dtype, device, config.cache_dtype
        g = self.geometry = Geometry.of(args, config.block_size, config.next_n, config.cache_dtype)
        bs, d, dI = config.block_size, args.head_dim, args.index_head_dim
        n_win = config.num_slots * g.blocks_needed("win", 0)
        # the growing pools' block counts, as the accounting's (``BlockManager``)
        blocks = {p: config.num_blocks.get(p, 0) if g.blocks_needed(p, 1 << 30) else 0 for p in GROWING}
        self.kv_codec, self.idx_codec = codecs_for(config.cache_dtype, d, args.qk_rope_head_dim, dI, dtype)

        def kv_rows(n: int) -> CacheRows:
            return CacheRows.zeros(self.kv_codec, n, device)

        f32 = dict(dtype=torch.float32, device=device)
        S = config.num_slots
        ring_blocks = g.blocks_needed("win", 0)
        self.pad_slot, self.pad_win_blocks = S, list(range(n_win, n_win + ring_blocks))
        self.win = [kv_rows((n_win + ring_blocks) * bs) for _ in range(g.num_layers)]
        # the MTP layers' window rings (next_n > 0), indexed by the same ``win`` block tables
        self.mtp_win = [kv_rows((n_win + ring_blocks) * bs) for _ in range(g.mtp_layers)]
        self.cmp_kv, self.idx_kv, self.comp, self.idx_comp = {}, {}, {}, {}
        # compressor states: one (kv, score) pair of tensors per kind for all its layers, each
        # layer's a view, so a graph verify step's rollback (spec_decode.SpanRollback) saves and
        # restores every layer's rows in one op per tensor
        self.comp_stacks: dict[str, tuple[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        kinds = (("c4", g.csa_layers, CSA_RATIO, 2 * d, self.comp), ("c4_idx", g.csa_layers, CSA_RATIO, 2 * dI, self.idx_comp),
                 ("c128", g.hca_layers, HCA_RATIO, d, self.comp))
        for name, layers, ratio, width, views in kinds:
            if layers:
                shape = (len(layers), S + 1, g.state_rows[ratio], width)
                kv, score = torch.zeros(shape, **f32), torch.zeros(shape, **f32)
                self.comp_stacks[name] = (ratio, (kv, score))
                for j, l in enumerate(layers):
                    views[l] = (kv[j], score[j])
        for l in g.csa_layers:
            n = blocks["c4"] * bs + 1
            self.cmp_kv[l], self.idx_kv[l] = kv_rows(n), CacheRows.zeros(self.idx_codec, n, device)
        for l in g.hca_layers:
            self.cmp_kv[l] = kv_rows(blocks["c128"] * bs + 1)
        self.trash_row = {p: blocks[p] * bs for p in GROWING}

    def tensors(self) -> list[torch.Tensor]:
        """Every pool tensor: the KV and indexer caches' stored parts, then the compressor states."""
        rows = [*self.win, *self.mtp_win, *self.cmp_kv.values(), *self.idx_kv.values()]
        return [*(p for r in rows for p in r.parts),
                *(t for pair in [*self.comp.values(), *self.idx_comp.values()] for t in pair)]

    def reset_slot(self, slot: int) -> None:
        """Reset a new request's compressor state (CSA previous-window scores at -inf, §3.4)."""
        for l, (kv, score) in self.comp.items():
            _reset_comp(kv[slot], score[slot], l in self.idx_comp)
        for kv, score in self.idx_comp.values():
            _reset_comp(kv[slot], score[slot], True)

    def copy_state(self, src: SeqBlocks, dst: SeqBlocks, num_tokens: int) -> None:
        """Make ``dst`` hold ``src``'s state after ``num_tokens`` tokens (a multiple of 128: both
        compressors' remainders hold no token, ``engine.core.prefix_cache``): every layer's whole
        window ring, the MTP layers' too (position p sits at ring slot p % ring_len in both), the state slot, and the
        CSA / HCA entry rows of the blocks they do not share. Device copies, one per pool tensor."""
        bs = self.config.block_size
        dev = self.device

        def rows(blocks: list[int], n: int) -> torch.Tensor:
            return (torch.tensor(blocks, dtype=torch.long, device=dev)[:, None] * bs
                    + torch.arange(bs, device=dev)).flatten()[:n]

        src_win, dst_win = rows(src.tables["win"], self.geometry.ring_len), rows(dst.tables["win"], self.geometry.ring_len)
        for ring in (*self.win, *self.mtp_win):
            ring.scatter(dst_win, ring.gather(src_win))
        for _, pair in self.comp_stacks.values():
            for t in pair:
                t[:, dst.state_slot] = t[:, src.state_slot]
        for p, caches in (("c4", [*(self.cmp_kv[l] for l in self.geometry.csa_layers), *self.idx_kv.values()]),
                          ("c128", [self.cmp_kv[l] for l in self.geometry.hca_layers])):
            n = self.geometry.entries(p, num_tokens)
            own = [i for i, (a, b) in enumerate(zip(src.tables.get(p, []), dst.tables.get(p, []))) if a != b and i * bs < n]
            if not own:
                continue
            k = sum(min(bs, n - i * bs) for i in own)    # only the last of them can be partial
            s_rows, d_rows = rows([src.tables[p][i] for i in own], k), rows([dst.tables[p][i] for i in own], k)
            for c in caches:
                c.scatter(d_rows, c.gather(s_rows))

    def apply(self, op: PoolOp) -> None:
        """Apply a "reset" or "copy" ``PoolOp`` (the other kinds concern the runner, not the pools)."""
        if op.kind == "reset":
            self.reset_slot(op.args[0])
        elif op.kind == "copy":
            src_slot, src_tables, dst_slot, dst_tables, n = op.args
            self.copy_state(SeqBlocks(src_slot, dict(src_tables)), SeqBlocks(dst_slot, dict(dst_tables)), n)

    def sequence_state(self, held: SeqBlocks, num_tokens: int) -> PagedSequenceState:
        """The model-facing state of the holding ``held`` with ``num_tokens`` tokens already processed."""
        return PagedSequenceState(self, held, num_tokens)

    def mtp_state(self, held: SeqBlocks, num_tokens: int, layer: int = 0) -> "PagedLayerState":
        """MTP layer ``layer``'s window state of the holding ``held`` with ``num_tokens`` positions
        drafted over (``forward_mtp`` advances its ``num_tokens``). Raises IndexError."""
        table = torch.tensor(held.tables["win"], dtype=torch.long, device=self.device)
        return PagedLayerState.window_only(self, self.mtp_win[layer], table, num_tokens)


class LocalCache(BlockManager):
    """A ``BlockManager`` over its own ``PagedCache`` (``paged``), each ``PoolOp`` applied as it is
    recorded: one process with no model runner (tests, benchmarks, tools)."""

    def __init__(self, args: ModelArgs, config: CacheConfig, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__(args, config)
        self.paged = PagedCache(args, config, dtype, device)

    def _applied(self, out):
        for op in self.take_ops():
            self.paged.apply(op)
        return out

    def allocate(self, seq_id, num_tokens: int, prefix: bytes | None = None) -> SeqBlocks:
        return self._applied(super().allocate(seq_id, num_tokens, prefix))

    def cache_prefix(self, seq_id, key: bytes, num_tokens: int, chain: tuple[bytes, ...]) -> bool:
        return self._applied(super().cache_prefix(seq_id, key, num_tokens, chain))

    def free(self, seq_id) -> None:
        self._applied(super().free(seq_id))

    def sequence_state(self, seq_id, num_tokens: int) -> PagedSequenceState:
        """The model-facing state of ``seq_id`` after ``num_tokens`` tokens. Raises KeyError."""
        return self.paged.sequence_state(self.seqs[seq_id], num_tokens)

    def mtp_state(self, seq_id, num_tokens: int, layer: int = 0) -> "PagedLayerState":
        return self.paged.mtp_state(self.seqs[seq_id], num_tokens, layer)

    def tensors(self) -> list[torch.Tensor]:
        return self.paged.tensors()


def _reset_comp(kv: torch.Tensor, score: torch.Tensor, overlap: bool) -> None:
    """Empty compressor remainder; CSA's previous-window scores start at -inf (weight 0, §3.4)."""
    kv.zero_()
    score.zero_()
    if overlap:
        score[CSA_RATIO:2 * CSA_RATIO, : score.shape[1] // 2] = float("-inf")


def kv_budget_bytes(model, mem_fraction_static: float, cpu_memory_bytes: int) -> int:
    """State budget (bytes) of ``model`` (a loaded ``Transformer``): ``mem_fraction_static`` x
    memory - weight bytes. Memory is the device total on CUDA / Ascend (``torch.npu`` exists once
    torch_npu is imported), and the configured ``cpu_memory_bytes`` on CPU, there being no device
    to query."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    dev = model.embed.weight.device
    if dev.type in ("cuda", "npu"):
        total = getattr(torch, dev.type).mem_get_info(dev)[1]
    else:
        total = cpu_memory_bytes
    return int(total * mem_fraction_static) - weights


def size_pools(model, block_size: int, batch_size: int, mem_fraction_static: float, cpu_memory_bytes: int,
               num_kv_blocks: int | None = None, cache_dtype: CacheDtype | None = None, next_n: int = 0,
               prefix_slots: int | None = None) -> CacheConfig:
    """Pool geometry for ``model`` (a loaded ``Transformer``) within ``kv_budget_bytes``, the
    caches stored as ``cache_dtype`` (None: unquantised).

    ``next_n``: MTP depth (the ring and compressor state keep its extra room, plus the MTP rings);
    ``prefix_slots``: the prefix cache's snapshot rings and slots (None: prefix caching off).
    ``num_kv_blocks`` (scheduler_config.num_kv_blocks) sets the CSA pool; the HCA pool gets the
    same token reach and at least ``batch_size`` blocks. None: ``plan_cache`` fills the budget.
    Raises:
        ValueError: no budget left after the weights, or ``num_kv_blocks`` over it.
    """
    a = model.args
    budget = kv_budget_bytes(model, mem_fraction_static, cpu_memory_bytes)
    if budget <= 0:
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        raise ValueError(f"mem_fraction_static x memory leaves no room for state: the weights alone take "
                         f"{weights} bytes; raise mem_fraction_static / cpu_memory_gb")
    if num_kv_blocks is not None:
        # HCA blocks: the same token reach as the CSA pool, and at least one per running request
        c128 = max(batch_size, math.ceil(num_kv_blocks * CSA_RATIO / HCA_RATIO))
        cfg = CacheConfig(block_size, batch_size, {"c4": num_kv_blocks, "c128": c128}, next_n,
                          cache_dtype or CacheDtype(), prefix_slots)
        need = pool_bytes(a, model.dtype, cfg)
        if need > budget:
            raise ValueError(f"num_kv_blocks: {num_kv_blocks} blocks need {need} bytes of state pools, over "
                             f"the {budget} bytes mem_fraction_static leaves; lower it or raise the memory")
    else:
        cfg = plan_cache(a, model.dtype, block_size, batch_size, budget, next_n, cache_dtype, prefix_slots)
    return cfg
