"""Decode runner: eager, or graph mode over batch-size buckets (reference/dsv4-architecture.md §8.4).

``exe_mode`` (run config ``model_config.exe_mode``) picks how single-token rows (decode) run;
prefill always runs eager through ``Transformer.forward_batch``:

    eager         the model's eager path, no runner
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
from itertools import accumulate
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
        """(token ids, first position, state slot, block tables) per row -> the step's ``B * span``
        flat rows (``StaticDecoder``: token j of row b at ``b * span + j``, padding past a row's
        tokens and past its rows), with the entry tables of context bucket C."""
        T, c = self.span, self.cache
        assert len(rows) <= B and all(1 <= len(r[0]) <= T for r in rows)
        tokens = torch.zeros(B * T, dtype=torch.long)
        positions = torch.zeros(B * T, dtype=torch.long)
        slots = torch.full((B * T,), c.pad_slot, dtype=torch.long)
        blocks: list[dict | None] = [None] * (B * T)
        for b, (toks, pos, slot, tables) in enumerate(rows):
            n = len(toks)
            tokens[b * T:b * T + n] = torch.tensor(toks, dtype=torch.long)
            positions[b * T:b * T + n] = torch.arange(pos, pos + n)
            slots[b * T:b * T + n] = slot
            blocks[b * T:b * T + n] = [tables] * n
        t = self.static.tables(blocks, B * T, C)
        out = [tokens, positions, slots, t["win"], t["c4"], t["c128"]]
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


def forward_packed(executor, runner: "DecodeRunner | None", batch, ids: list[int], tokens: torch.Tensor,
                   hook=None, spec: bool = False):
    """Hidden states ``[sum(num_tokens), H]`` of a scheduled batch (``ids``: its token ids on the
    host, ``tokens`` on the device; ``hook``: the forward's layer hook): all eager through
    ``executor``, or with a graph ``runner`` its rows of up to ``runner.span`` tokens (decode; an
    MTP engine's verify spans) through the runner and the rest eager (prefill).

    ``spec``: an MTP step (``spec_graph``): returns (hidden, output streams ``[sum(num_tokens), n,
    H]``), the MTP layer's input (``Transformer.forward_batch(streams=True)``).
    """
    cache, nums = executor.cache, batch.num_tokens
    span = runner.span if runner is not None else 0
    fast = [i for i, n in enumerate(nums) if n <= span]
    rest = [i for i, n in enumerate(nums) if n > span]

    def eager(tok: torch.Tensor, sel: list[int], **kw):
        if spec:                        # only asked for: a multi-rank executor's forward_batch takes no flag
            kw["streams"] = True
        states = [cache.sequence_state(batch.seqs[i].seq_id, batch.seqs[i].num_computed) for i in sel]
        return executor.forward_batch(tok, states, [nums[i] for i in sel], **kw)

    if not fast:
        return eager(tokens, rest, layer_hook=hook)
    m, dev = executor.model, tokens.device
    offs = [0, *accumulate(nums)]
    shapes = [(m.args.hidden_size,), (m.args.hc_mult, m.args.hidden_size)][:1 + spec]
    outs = [torch.empty(tokens.shape[0], *sh, dtype=dt, device=dev) for sh, dt in zip(shapes, (m.dtype, m.residual_dtype))]

    def packed(sel: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(offs[i], offs[i + 1]) for i in sel]).to(dev)

    def put(idx: torch.Tensor, got) -> None:
        for o, g in zip(outs, got if spec else (got,)):
            if g is not None:           # a multi-rank leader's streams stay on each rank
                o[idx] = g

    if rest:
        idx = packed(rest)
        put(idx, eager(tokens[idx], rest))
    held = [cache.seqs[batch.seqs[i].seq_id] for i in fast]
    rows = [(ids[offs[i]:offs[i + 1]], batch.seqs[i].num_computed, h.state_slot, h.tables) for i, h in zip(fast, held)]
    put(packed(fast), executor.decode_rows(runner, rows, [batch.seqs[i].seq_id for i in fast]))
    return tuple(outs) if spec else outs[0]


def spec_graph(executor, runner: "DecodeRunner | None", batch, ids: list[int], tokens: torch.Tensor):
    """An MTP step's graph forward for ``Executor.forward_spec`` (``forward_packed`` with
    ``spec``), or None to run it eager: no runner, or on several ranks (``executor.rows_mode``)
    a batch with a prefill chunk longer than the span (each rank keeps the streams of its graph
    rows only, so a step is all graph or all eager there)."""
    if runner is None or (executor.rows_mode is not None and max(batch.num_tokens) > runner.span):
        return None
    want = 1 + runner.cache.config.next_n
    if runner.span != want:           # a longer verify span would run eager with no rollback
        raise ValueError(f"an MTP engine's graph runner needs span 1 + next_n = {want}, got {runner.span}")
    return lambda: forward_packed(executor, runner, batch, ids, tokens, spec=True)


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
