"""Decode runner: eager, or graph mode over batch-size buckets (reference/dsv4-architecture.md §8.4).

``exe_mode`` (run config ``model_config.exe_mode``) picks how single-token rows (decode) run;
prefill always runs eager through ``Transformer.forward_batch``:

    eager         the model's eager path, no runner
    npugraph_ex   Ascend: torch.compile(backend="npugraph_ex") (CANN AclGraph); CUDA: CUDA graphs;
                  CPU: torch.compile (inductor)
    ge_graph      Ascend: torchair's GE backend; CUDA / CPU: as npugraph_ex

The graph-mode step is ``StaticDecoder`` (fixed shapes, no host syncs), padded to the smallest
batch bucket (1, 2, 4, ... up to the batch size; on CPU the batch size only) that holds the rows
and run with the entry tables of the smallest context bucket (256, 512, ... up to max_model_len)
that holds the longest row, so a step costs O(its longest context), not O(max_model_len). Every
(batch, context) pair is warmed up (captured / compiled) at start so no request pays for a
compile; on CPU, where graph mode is the test vehicle and each compile takes tens of seconds, the
smallest context bucket is warmed up and the others compile on first use.
"""
from __future__ import annotations

import importlib
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import torch

from engine.core.kv_cache import PagedCache
from engine.core.static_decode import StaticDecoder
from engine.model.transformer import Transformer
from engine.platform import Platform

log = logging.getLogger(__name__)

GRAPH_MODES = ("npugraph_ex", "ge_graph")


@dataclass(frozen=True)
class ExecConfig:
    """How decode runs (run-config keys in parentheses).

    exe_mode (model_config.exe_mode); multi_streams (custom_params.enable_multi_streams);
    limit_core (custom_params.enable_limit_core); static_kernel (model_config.enable_static_kernel);
    cache_compile (model_config.enable_cache_compile) with compile_dir (model_config.output_path);
    dynamic_graph (model_config.enable_dynamic_graph, npugraph_ex only); superkernel
    (custom_params.enable_superkernel).
    """

    exe_mode: str = "eager"
    multi_streams: bool = False
    limit_core: bool = False
    static_kernel: bool = False
    cache_compile: bool = False
    compile_dir: str = ""
    dynamic_graph: bool = False
    superkernel: bool = False

    @property
    def graph(self) -> bool:
        return self.exe_mode in GRAPH_MODES


def buckets(max_batch: int, smallest: int = 1) -> list[int]:
    """Buckets: powers of two from ``smallest`` below ``max_batch``, then ``max_batch``."""
    out, b = [], smallest
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


SMALLEST_CONTEXT = 256


def context_buckets(max_model_len: int) -> list[int]:
    """Context-length buckets (tokens): 256, 512, ... below ``max_model_len``, then it."""
    return buckets(max_model_len, SMALLEST_CONTEXT)


class DecodeRunner:
    """Runs B single-token rows through a compiled / captured ``StaticDecoder`` step.

    Args:
        model, cache: the engine's model and pools. max_model_len: tokens per request.
        max_batch: rows per step at most (the engine's batch size). platform: the device.
        cfg: ``ExecConfig`` with a graph ``exe_mode``.
        rows_mode: on a multi-rank model (``model.parallel``), the row mode every step runs in
            ("replicated" or "dp", ``engine.parallel.context``), always with fixed row counts: every
            rank runs the same bucket, so the step's collectives have fixed shapes and are captured
            with it. None: a single-rank model.
    Raises:
        PlatformError: a graph backend this machine lacks (torchair for ge_graph on Ascend).
    """

    def __init__(self, model: Transformer, cache: PagedCache, max_model_len: int, max_batch: int,
                 platform: Platform, cfg: ExecConfig, rows_mode: str | None = None):
        self.platform, self.cfg, self.cache = platform, cfg, cache
        self.parallel = model.parallel if rows_mode is not None else None
        self.rows_mode = rows_mode
        self.static = StaticDecoder(model, cache, max_model_len, platform, cfg.multi_streams, cfg.limit_core)
        # CPU replays nothing: one bucket (the batch size) is one compile instead of log2(batch) ones
        self.buckets = [max_batch] if platform.kind == "cpu" else buckets(max_batch)
        self.contexts = context_buckets(max_model_len)
        self.device = model.embed.weight.device
        self._fns: dict[tuple[int, int], object] = {}
        self._eager = False
        self._compiled = None
        self._pool = None                      # CUDA graphs of every bucket share one memory pool
        self.warmup_s = 0.0
        self.backend = {"cpu": "torch.compile (inductor)", "cuda": "CUDA graphs"}.get(
            platform.kind, f"torch.compile (backend {'npugraph_ex' if cfg.exe_mode == 'npugraph_ex' else 'torchair GE'})")

    # ---- build ------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile / capture every (batch, context) bucket now (on CPU the smallest context only;
        padding rows only: no request state is touched)."""
        t = time.perf_counter()
        contexts = self.contexts[:1] if self.platform.kind == "cpu" else list(reversed(self.contexts))
        for B in reversed(self.buckets):       # largest batch and context first: the graphs share one memory pool
            for C in contexts:
                self.step([], B, C)
        self.platform.synchronize()
        self.warmup_s = time.perf_counter() - t
        log.info("decode graphs ready: %s, batch buckets %s, context buckets %s, %.1f s", self.backend,
                 self.buckets, self.contexts, self.warmup_s)

    def use_eager(self) -> None:
        """Run the static step uncompiled: graph mode's math without its compile time (tests)."""
        self._eager = True

    def _fn(self, B: int, C: int):
        if self._eager:
            return self.static
        fn = self._fns.get((B, C))
        if fn is None:
            fn = self._fns[(B, C)] = self._capture(B, C) if self.platform.kind == "cuda" else self._compile()
        return fn

    def _compile(self):
        """One compiled callable for every bucket (a specialisation per bucket shape)."""
        if self._compiled is None:
            kind, cfg = self.platform.kind, self.cfg
            # one specialisation per bucket: keep dynamo from falling back to eager past its limit
            dyn = torch._dynamo.config
            dyn.recompile_limit = max(dyn.recompile_limit, 2 * len(self.buckets) * len(self.contexts))
            if kind == "cpu":
                self._compiled = torch.compile(self.static.__call__, fullgraph=True, dynamic=False)
            elif cfg.exe_mode == "npugraph_ex":
                self._compiled = _npugraph_ex(self.static.__call__, cfg)
            else:
                self._compiled = _ge_graph(self.static.__call__, cfg)
        return self._compiled

    def _rows(self):
        """The model's row mode for a step (fixed counts), or nothing on a single rank."""
        return self.parallel.rows(self.rows_mode, fixed=True) if self.parallel is not None else nullcontext()

    def _capture(self, B: int, C: int):
        """A CUDA graph of the step for batch bucket B and context bucket C, replayed over static
        input buffers."""
        p = self.platform
        bufs = [t.to(self.device) for t in self._inputs([], B, C)]
        s = p.new_stream()
        with p.side_stream(s):                 # warm-up launches outside the capture (cuBLAS handles)
            for _ in range(2):
                self.static(*bufs)
        p.join(s)
        graph = p.new_graph()
        if self._pool is None:
            self._pool = p.graph_pool_handle()
        with p.capture(graph, pool=self._pool):
            out = self.static(*bufs)

        def replay(*inputs: torch.Tensor) -> torch.Tensor:
            for buf, t in zip(bufs, inputs):
                buf.copy_(t, non_blocking=True)
            graph.replay()
            return out
        return replay

    # ---- run --------------------------------------------------------------------------------
    def _inputs(self, rows: list[tuple[int, int, int, dict]], B: int, C: int) -> list[torch.Tensor]:
        """(token, position, state slot, block tables) per row -> the step's padded inputs, the
        entry tables of context bucket C."""
        n, c = len(rows), self.cache
        tokens = torch.zeros(B, dtype=torch.long)
        positions = torch.zeros(B, dtype=torch.long)
        slots = torch.full((B,), c.pad_slot, dtype=torch.long)
        for i, (tok, pos, slot, _) in enumerate(rows):
            tokens[i], positions[i], slots[i] = tok, pos, slot
        t = self.static.tables([r[3] for r in rows], B, C)
        out = [tokens, positions, slots, t["win"], t["c4"], t["c128"]]
        assert n <= B
        return [x.to(self.device, non_blocking=True) for x in out]

    def bucket(self, n: int) -> int:
        """The smallest bucket holding ``n`` rows. Raises ValueError past the largest."""
        for B in self.buckets:
            if B >= n:
                return B
        raise ValueError(f"decode runner: {n} rows exceed the largest bucket {self.buckets[-1]}")

    def context_bucket(self, n: int) -> int:
        """The smallest context bucket holding ``n`` tokens. Raises ValueError past max_model_len."""
        for C in self.contexts:
            if C >= n:
                return C
        raise ValueError(f"decode runner: {n} tokens exceed max_model_len {self.contexts[-1]}")

    def run(self, rows: list[tuple[int, int, int, dict]]) -> torch.Tensor:
        """rows: (token id, position, state slot, {pool: block ids}) -> hidden ``[len(rows), H]``.

        Each row's state must already hold room for its position (the scheduler allocates first).
        """
        B, C = self.bucket(len(rows)), self.context_bucket(max(r[1] for r in rows) + 1)
        return self.step(rows, B, C)[: len(rows)]

    def step(self, rows: list[tuple[int, int, int, dict]], B: int, C: int) -> torch.Tensor:
        """``run``'s step at batch bucket B and context bucket C chosen by the caller (on several
        ranks every rank must use the same ones; a rank without rows runs padding) -> hidden
        ``[B, H]``, the padding rows' after this rank's."""
        with self._rows():
            return self._fn(B, C)(*self._inputs(rows, B, C))


def forward_packed(executor, runner: "DecodeRunner | None", batch, ids: list[int], tokens: torch.Tensor,
                   hook=None) -> torch.Tensor:
    """Hidden states ``[sum(num_tokens), H]`` of a scheduled batch (``ids``: its token ids on the
    host, ``tokens`` on the device; ``hook``: the forward's layer hook): all eager through
    ``executor``, or with a graph ``runner`` its single-token rows (decode) through the runner
    and the rest eager (prefill)."""
    cache = executor.cache
    one = [i for i, n in enumerate(batch.num_tokens) if n == 1] if runner is not None else []
    if not one:
        states = [cache.sequence_state(s.seq_id, s.num_computed) for s in batch.seqs]
        return executor.forward_batch(tokens, states, batch.num_tokens, layer_hook=hook)
    m = executor.model
    offs = [0, *accumulate(batch.num_tokens)]
    hidden = torch.empty(tokens.shape[0], m.args.hidden_size, dtype=m.dtype, device=tokens.device)
    rest = [i for i, n in enumerate(batch.num_tokens) if n != 1]
    if rest:
        idx = torch.cat([torch.arange(offs[i], offs[i + 1], device=tokens.device) for i in rest])
        states = [cache.sequence_state(batch.seqs[i].seq_id, batch.seqs[i].num_computed) for i in rest]
        hidden[idx] = executor.forward_batch(tokens[idx], states, [batch.num_tokens[i] for i in rest])
    held = [cache.seqs[batch.seqs[i].seq_id] for i in one]
    rows = [(ids[offs[i]], batch.seqs[i].num_computed, h.state_slot, h.tables) for i, h in zip(one, held)]
    hidden[torch.tensor([offs[i] for i in one], device=tokens.device)] = executor.decode_rows(
        runner, rows, [batch.seqs[i].seq_id for i in one])
    return hidden


def _npugraph_ex(fn, cfg: ExecConfig):
    """Ascend AclGraph capture through torch.compile (§8.4): ``backend="npugraph_ex"`` with
    frozen parameters, static kernels and the super-kernel option as configured; with
    ``enable_cache_compile`` the compiled graph is cached under ``compile_dir``."""
    importlib.import_module("torch_npu")       # registers the npugraph_ex backend
    options = {"frozen_parameter": True, "static_kernel_compile": cfg.static_kernel,
               "super_kernel_optimize": cfg.superkernel}
    if cfg.cache_compile:
        cache_dir = str(Path(cfg.compile_dir or ".") / "compile_cache")
        return torch.npu.npugraph_ex.inference.cache_compile(fn, cache_dir=cache_dir, options=options)
    return torch.compile(fn, backend="npugraph_ex", fullgraph=True, dynamic=cfg.dynamic_graph, options=options)


def _ge_graph(fn, cfg: ExecConfig):
    """torchair GE graph (§8.4): ``get_npu_backend(CompilerConfig)`` with frozen parameters and
    StableRDFS topological sorting."""
    import torchair
    conf = torchair.CompilerConfig()
    conf.experimental_config.frozen_parameter = True
    conf.experimental_config.topology_sorting_strategy = "StableRDFS"
    return torch.compile(fn, backend=torchair.get_npu_backend(compiler_config=conf), fullgraph=True, dynamic=False)
