"""The captured decode step: graph mode over batch-size buckets (reference/dsv4-architecture.md §8.4).

``exe_mode`` (run config ``model_config.exe_mode``) picks how the decode rows run (the model
runner's rows of up to ``span`` tokens, ``engine.core.model_runner``); prefill always runs eager
through ``Transformer.forward_batch``:

    eager         the decode step (``StaticDecoder``) uncompiled, exact per row; no ``DecodeRunner``
    npugraph_ex   Ascend: torch.compile(backend="npugraph_ex") (CANN AclGraph); CUDA: CUDA graphs;
                  CPU: torch.compile (inductor) of the layer step, one graph per layer kind
    ge_graph      Ascend: torchair's GE backend; CUDA / CPU: as npugraph_ex

The graph-mode step is ``StaticDecoder`` (fixed shapes, no host syncs), padded to the smallest
batch bucket (1, 2, 4, ... up to the batch size; on CPU the batch size only; or
``model_config.graph_batch_sizes``) that holds the rows
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
from pathlib import Path

import torch

from engine.core.kv_cache import PagedCache
from engine.core.static_decode import StaticDecoder, layer_kinds
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
    (custom_params.enable_superkernel); batch_sizes (model_config.graph_batch_sizes: the batch
    buckets, ``DecodeRunner``).
    """

    exe_mode: str = "eager"
    multi_streams: bool = False
    limit_core: bool = False
    static_kernel: bool = False
    cache_compile: bool = False
    compile_dir: str = ""
    dynamic_graph: bool = False
    superkernel: bool = False
    batch_sizes: tuple[int, ...] | None = None

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


def batch_buckets(max_batch: int, kind: str, sizes: tuple[int, ...] | None = None) -> list[int]:
    """The batch buckets of a rank: ``sizes`` below ``max_batch``, then ``max_batch``; without
    ``sizes`` ``buckets(max_batch)``, or on CPU ``max_batch`` alone (CPU replays nothing, and each
    bucket is a compile of tens of seconds; a CPU server that also runs one request at a time lists
    1, so that request does not pay for a full batch of padding rows)."""
    if sizes is None:
        return [max_batch] if kind == "cpu" else buckets(max_batch)
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def context_buckets(max_model_len: int) -> list[int]:
    """Context-length buckets (tokens): 256, 512, ... below ``max_model_len``, then it."""
    return buckets(max_model_len, SMALLEST_CONTEXT)


class DecodeRunner:
    """Runs B rows (one sequence's next ``span`` tokens or fewer each) through a compiled /
    captured ``StaticDecoder`` step.

    Args:
        model, cache: the engine's model and pools. max_model_len: tokens per request.
        max_batch: rows per step at most (the engine's batch size). platform: the device.
        cfg: ``ExecConfig`` with a graph ``exe_mode``.
        rows_mode: on a multi-rank model (``model.parallel``), the row mode every step runs in
            ("replicated" or "dp", ``engine.parallel.context``), always with fixed row counts: every
            rank runs the same bucket, so the step's collectives have fixed shapes and are captured
            with it. None: a single-rank model.
        span: tokens per row at most (an MTP engine: ``1 + next_n``; ``StaticDecoder``'s span).
    Raises:
        PlatformError: a graph backend this machine lacks (torchair for ge_graph on Ascend).
    """

    def __init__(self, model: Transformer, cache: PagedCache, max_model_len: int, max_batch: int,
                 platform: Platform, cfg: ExecConfig, rows_mode: str | None = None, span: int = 1):
        self.platform, self.cfg, self.cache, self.span = platform, cfg, cache, span
        self.parallel = model.parallel if rows_mode is not None else None
        self.rows_mode = rows_mode
        self.static = StaticDecoder(model, cache, max_model_len, platform, cfg.multi_streams, cfg.limit_core, span)
        self.buckets = batch_buckets(max_batch, platform.kind, cfg.batch_sizes)
        self.contexts = context_buckets(max_model_len)
        self.device = model.embed.weight.device
        self._fns: dict[tuple[int, int], object] = {}
        self._eager = False
        self._compiled = None
        self._pool = None                      # CUDA graphs of every bucket share one memory pool
        self.warmup_s = 0.0
        self.backend = {"cpu": "torch.compile (inductor, per layer kind)", "cuda": "CUDA graphs"}.get(
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
            kinds = len(layer_kinds(self.static.model)) if kind == "cpu" else 1
            dyn.recompile_limit = max(dyn.recompile_limit, 2 * kinds * len(self.buckets) * len(self.contexts))
            if kind == "cpu":
                # regional: inductor compiles one layer of each kind per bucket (Flash: a handful
                # of graphs for 43 layers), the step around the layers runs eager
                self.static.block = torch.compile(self.static.layer_step, fullgraph=True, dynamic=False)
                self._compiled = self.static
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
    def _inputs(self, rows: list[tuple[list[int], int, int, dict]], B: int, C: int) -> list[torch.Tensor]:
        """``StaticDecoder.inputs`` at span ``self.span`` (the device tensors only)."""
        return self.static.inputs(rows, B, self.span, C)[0]

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

    def run(self, rows: list[tuple[list[int], int, int, dict]]):
        """rows: (token ids (1 .. span of them), first position, state slot, {pool: block ids})
        -> hidden ``[n, H]`` of the rows' n tokens in order; with span > 1 also their output
        streams ``[n, hc, H]`` (``StaticDecoder``).

        Each row's state must already hold room for its tokens (the scheduler allocates first).
        """
        B, C = self.bucket(len(rows)), self.context_bucket(max(r[1] + len(r[0]) for r in rows))
        out = self.step(rows, B, C)
        if self.span == 1:
            return out[: len(rows)]
        T = self.span
        idx = torch.tensor([b * T + j for b, r in enumerate(rows) for j in range(len(r[0]))], device=self.device)
        return tuple(o[idx] for o in out)

    def step(self, rows: list[tuple[list[int], int, int, dict]], B: int, C: int):
        """``run``'s step at batch bucket B and context bucket C chosen by the caller (on several
        ranks every rank must use the same ones; a rank without rows runs padding) -> what the
        ``StaticDecoder`` returns for the ``B * span`` flat rows (``_inputs``)."""
        with self._rows():
            return self._fn(B, C)(*self._inputs(rows, B, C))


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
