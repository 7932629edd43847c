"""Roofline for the DeepSeek-V4 model: hardware probes and an analytic cost model.

Units everywhere: bytes, FLOPs (2 x multiply-adds), seconds, GB/s = 1e9 bytes/s, GFLOP/s = 1e9
FLOP/s. The cost of a step is the memory it must move (weights read once per step, the decode
state read and written) and the arithmetic it must do; its hardware limit is

    limit_s = max(bytes / read_bandwidth, flops / gemm_peak)

and the larger term "binds" (memory or compute). Activations are assumed to stay in cache
(true for decode; a lower bound for prefill), and non-matmul element-wise work (norms, RoPE,
softmax, Sinkhorn) is left out of the FLOPs: the limit is a floor, not a prediction.

Terms, with the letters of reference/dsv4-architecture.md (H hidden, V vocab, n hc_mult, h heads,
d head_dim, q q_lora_rank, G o_groups, o o_lora_rank, W sliding_window, hI/dI/kI index_n_heads /
index_head_dim / index_topk, E/k/I experts / per token / width, S shared experts):

* weights (§2.2, as the checkpoint stores them, which is what the loader keeps;
  ``weight_inventory`` lists every one; FLOPs count the logical out x in of each linear):
  per layer mHC ``hc_{attn,ffn}_fn [(2+n)n, nH]`` (§3.2), attention ``wq_a [q,H]``, ``wq_b [hd,q]``,
  ``wkv [d,H]``, ``wo_a [G o, hd/G]``, ``wo_b [H, G o]`` (§3.3), compressor ``wkv``/``wgate
  [c d, H]`` with c = 2 for CSA, 1 for HCA (§3.4), indexer ``wq_b [hI dI, q]``, ``weights_proj
  [hI, H]`` and its own CSA compressor at width dI (§3.5), router ``gate [E, H]``, routed experts
  ``3 x [E, I, H]`` and the shared expert ``3 x [S I, H]`` (§3.7); embedding ``[V, H]``, LM head
  ``[V, H]``. The products of the LM head, router, compressors, indexer ``weights_proj`` and
  mHC run in fp32 in every compute dtype (``flops_fp32`` in a bf16 model); the rest in the
  compute dtype.
* decode, one step of B sequences at ``context`` tokens: every weight once, except the
  embedding (B rows), the compressors' ``ape`` (at most B of its m rows), the routed experts
  (the expected number of distinct experts B tokens touch, ``E (1 - (1 - k/E)^B)`` per layer)
  and the MTP block (not run). Per sequence and layer the
  state (§4): the window (``min(context, W-1)`` rows of d read, one written), HCA all
  ``(context+1)//128`` entries, CSA the ``min(kI, (context+1)//4)`` selected entries plus all
  ``(context+1)//4`` indexer keys of dI; each compressor's fp32 remainder rows (kv + score, width
  c d) written once and read once when their window closes, and the new entries written
  (amortised ``1/m`` per token). FLOPs: ``2 x params`` per token for every linear (routed experts:
  k of E), ``4 h d`` per attended key (QK and PV, §3.3 step 6), ``2 hI dI + 2 hI`` per indexer key
  (§3.5), the mHC mixes (§3.2).
* prefill of T tokens in chunks of c: weights once per chunk, per-token linears on T rows, the
  LM head on the last row only; attention keys summed over positions: window
  ``sum_p min(p+1, W)`` (~T W), CSA ``sum min(kI, (p+1)//4)`` (~T kI), HCA ``sum (p+1)//128``
  (~T^2/256), indexer ``sum (p+1)//4`` (~T^2/8) keys x ``2 hI dI`` FLOPs: O(T^2), it dominates
  long prompts. State: entries written once, and each chunk reads every entry before it.
"""
from __future__ import annotations

import math
import time

import torch

from engine.config import CSA_RATIO, HCA_RATIO, ModelArgs

GB = 1e9
MiB = 1 << 20
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype) -> int:
    """Bytes per element of a compute dtype: a torch dtype, its name ("float32", "bfloat16") or an int."""
    if isinstance(dtype, int):
        return dtype
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    return _DTYPE_BYTES[str(dtype).replace("torch.", "")]


def dtype_name(dtype) -> str:
    """"float32" / "bfloat16" for a torch dtype, name or byte count (4 -> float32, 2 -> bfloat16)."""
    if isinstance(dtype, int):
        return "float32" if dtype == 4 else "bfloat16"
    return str(dtype).replace("torch.", "")


# ---- hardware probes ---------------------------------------------------------------------------
def _best_time(fn, reps: int, budget_s: float) -> float:
    """Best wall time of ``fn()`` over up to ``reps`` calls (at least 2) within ``budget_s``."""
    fn()                                                            # warm-up (page faults, caches)
    best, t_end, i = float("inf"), time.perf_counter() + budget_s, 0
    while i < 2 or (i < reps and time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        i += 1
    return best


def _bandwidth_times(n_el: int, per: float) -> tuple[float, float, float]:
    """Best seconds of sum, dot and copy over an ``n_el`` fp32 buffer (freed on return)."""
    x = torch.rand(n_el)
    t_sum = _best_time(lambda: x.sum(), 8, per)
    t_dot = _best_time(lambda: torch.dot(x, x), 8, per)            # reads x once (both operands alias)
    y = torch.empty_like(x)
    t_copy = _best_time(lambda: y.copy_(x), 6, per)
    return t_sum, t_dot, t_copy


def _gemm_gflops(dtype: torch.dtype, n_max: int, budget_s: float) -> tuple[float, int]:
    """``(GFLOP/s, n)`` of the best n x n x n matmul in ``dtype``, n doubling from 256 to ``n_max``
    while the next size's warm-up and two timed calls (8x the work each) fit in ``budget_s``: a dtype
    without a fast CPU kernel (bf16 on a CPU without AVX-512 BF16: ~0.3 GFLOP/s, a minute per 2048^3
    call) is measured on a smaller matrix instead of taking minutes."""
    n = 256
    while True:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        t = _best_time(lambda: torch.mm(a, b), 6, budget_s / 3)
        if n >= n_max or 3 * 8 * t > budget_s:
            return 2 * n ** 3 / t / GB, n
        n *= 2


def probe_hardware(seconds: float = 2.0, buffer_mib: int = 512, gemm_n: int = 2048) -> dict:
    """Measure this machine with torch's current thread count (about ``seconds`` in all).

    * ``read_gbs``: best of ``torch.sum`` and ``torch.dot`` over a ``buffer_mib`` fp32 tensor
      (512 MiB by default, far beyond any cache), bytes read / best time;
    * ``copy_gbs``: ``dst.copy_(src)`` of the same size, (read + write bytes) / best time;
    * ``gemm_gflops``: ``{"float32", "bfloat16"}`` -> 2 n^3 / best time of an n x n x n matmul, n
      up to ``gemm_n`` as the time allows (``gemm_sizes``: the n of each dtype).

    Returns a dict of those plus ``threads``, ``buffer_mib``, ``gemm_n``, ``gemm_sizes``,
    ``seconds`` (spent).
    """
    t_start = time.perf_counter()
    per = seconds / 5
    nbytes = buffer_mib * MiB // 4 * 4
    t_sum, t_dot, t_copy = _bandwidth_times(nbytes // 4, per)
    gemm, sizes = {}, {}
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        gemm[name], sizes[name] = _gemm_gflops(dt, gemm_n, 2 * per)
    return {
        "threads": torch.get_num_threads(),
        "read_gbs": nbytes / min(t_sum, t_dot) / GB,
        "read_method": "sum" if t_sum <= t_dot else "dot",
        "read_sum_gbs": nbytes / t_sum / GB,
        "read_dot_gbs": nbytes / t_dot / GB,
        "copy_gbs": 2 * nbytes / t_copy / GB,
        "gemm_gflops": gemm,
        "buffer_mib": buffer_mib,
        "gemm_n": gemm_n,
        "gemm_sizes": sizes,
        "seconds": time.perf_counter() - t_start,
    }


# ---- weights -----------------------------------------------------------------------------------
def weight_inventory(args: ModelArgs, dtype=torch.float32, mtp: bool = True) -> dict[str, tuple[tuple[int, ...], int]]:
    """Every parameter of the loaded model, as the checkpoint stores it (the loader keeps every
    tensor as stored: FP8 / MXFP4 / int / bf16 / fp32, whatever the compute dtype): name (as
    ``Transformer.named_parameters``; routed experts stacked, their scales ``wN_scale``) ->
    (shape, bytes per element). The hash router's ``tid2eid`` is a buffer and is not listed.
    ``mtp``: include the MTP blocks (§3.8). ``dtype`` (the compute dtype) changes nothing here.
    """
    from engine.checkpoint.layout import checkpoint_layout
    from engine.checkpoint.loader import param_of
    from engine.checkpoint.shards import DTYPE_BYTES
    inv: dict[str, tuple[tuple[int, ...], int]] = {}
    for name, spec in checkpoint_layout(args).items():
        if (not mtp and name.startswith("mtp.")) or name.endswith("tid2eid"):
            continue
        mod, attr, e = param_of(name)
        shape = spec.shape if e is None else (args.n_routed_experts, *spec.shape)
        inv[f"{mod}.{attr}" if mod else attr] = (tuple(shape), DTYPE_BYTES[spec.dtype])
    return inv


def _linear_elements(args: ModelArgs) -> dict[str, int]:
    """Logical weight elements (out x in; all experts of a stack) of every linear, by parameter name:
    what a token's matmul FLOPs count, whatever the storage packs them into."""
    from engine.checkpoint.layout import model_linears
    out: dict[str, int] = {}
    for name, lin in model_linears(args).items():
        mod, attr, e = param_of_linear(name)
        out[f"{mod}.{attr}"] = out.get(f"{mod}.{attr}", 0) + lin.out_features * lin.in_features
    return out


def param_of_linear(name: str) -> tuple[str, str, int | None]:
    """A linear's weight parameter: (module, attribute, expert) of ``name.weight``."""
    from engine.checkpoint.loader import param_of
    return param_of(f"{name}.weight")


def weight_bytes(args: ModelArgs, dtype=torch.float32, mtp: bool = True) -> int:
    """Bytes of all parameters as stored (all experts; MTP blocks too unless ``mtp=False``)."""
    return sum(math.prod(s) * b for s, b in weight_inventory(args, dtype, mtp).values())


def expected_distinct_experts(n_experts: int, k: int, tokens: int) -> float:
    """Expected distinct experts ``tokens`` tokens touch, each picking k of E uniformly:
    ``E (1 - (1 - k/E)^tokens)``; = k for one token, -> E as tokens grow."""
    if tokens <= 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - k / n_experts) ** tokens)


def _part_of(name: str) -> str:
    """Cost-model part of a trunk parameter name."""
    if name == "embed.weight":
        return "embed"
    if name in ("head.weight", "norm.weight"):
        return "lm_head"
    if "hc_" in name:
        return "mhc"
    if ".attn.indexer." in name:
        return "indexer"
    if ".attn.compressor." in name:
        return "compressor"
    if name.endswith(("attn_norm.weight", "ffn_norm.weight")):
        return "norms"
    if ".attn." in name:
        return "attention"
    if ".ffn.gate." in name:
        return "router"
    if ".ffn.experts." in name:
        return "routed_experts"
    if ".ffn.shared_experts." in name:
        return "shared_expert"
    raise ValueError(f"roofline: no cost-model part for parameter {name!r}")


def _fp32_math(name: str) -> bool:
    """Weights whose products run in fp32 in every compute dtype (§5): LM head, router,
    compressors, the indexer's ``weights_proj``, the mHC mixes."""
    return (name == "head.weight" or ".ffn.gate." in name or ".compressor." in name or "weights_proj" in name
            or name.endswith("_fn"))


def _add(parts: dict, part: str, nbytes: float = 0.0, flops: float = 0.0, fp32_flops: float = 0.0) -> None:
    p = parts.setdefault(part, {"bytes": 0.0, "flops": 0.0, "flops_fp32": 0.0})
    p["bytes"] += nbytes
    p["flops"] += flops
    p["flops_fp32"] += fp32_flops


def _weight_terms(args: ModelArgs, cb: int, tokens: int, weight_reads: int, expert_tokens: list[int],
                  embed_rows: int, head_rows: int) -> dict:
    """Weight bytes and per-token FLOPs of the trunk, by part.

    ``tokens`` rows run every linear; ``weight_reads`` times every weight is read (chunks);
    ``expert_tokens``: tokens per read (experts touched, compressor ``ape`` rows (window slots)
    used each time: at most one per token); the embedding reads
    ``embed_rows`` rows; the LM head runs once, on ``head_rows`` rows.
    """
    parts: dict = {}
    E, k = args.n_routed_experts, args.num_experts_per_tok
    touched = sum(expected_distinct_experts(E, k, t) for t in expert_tokens)
    matmul = _linear_elements(args)                             # logical out x in, by parameter
    for name, (shape, b) in weight_inventory(args, cb, mtp=False).items():
        part, stored = _part_of(name), math.prod(shape) * b
        numel = matmul.get(name, math.prod(shape) if name.endswith("_fn") else 0)   # 0: not a matmul weight
        fp32 = cb != 4 and _fp32_math(name)
        if part == "embed":
            _add(parts, part, embed_rows * shape[1] * b)
        elif name.endswith(".ape"):                             # one row per window slot in use
            rows = sum(min(shape[0], t) for t in expert_tokens)
            _add(parts, part, rows * shape[1] * b)
        elif part == "routed_experts":
            fl = 2 * tokens * k * numel / E
            _add(parts, part, touched * stored / E, fl, fl if fp32 else 0.0)
        else:
            head = part == "lm_head"                            # runs once, on head_rows rows
            fl = 2 * (head_rows if head else tokens) * numel
            _add(parts, part, (1 if head else weight_reads) * stored, fl, fl if fp32 else 0.0)
    # mHC mixing (§3.2): per layer and site y = sum_j pre_j X_j (nH), hc_post comb^T X + post f
    # (n^2 H + nH); the final hc_head collapse (nH). MACs -> 2 x.
    n, H, L = args.hc_mult, args.hidden_size, args.num_hidden_layers
    fl = 2 * tokens * (L * 2 * (n * H + n * n * H + n * H) + n * H)
    _add(parts, "mhc", 0.0, fl, fl if cb != 4 else 0.0)
    return parts


def _finish(parts: dict, **extra) -> dict:
    parts = {k: {kk: float(vv) for kk, vv in v.items()} for k, v in parts.items()}
    out = {"bytes": sum(p["bytes"] for p in parts.values()),
           "flops": sum(p["flops"] for p in parts.values()),
           "flops_fp32": sum(p["flops_fp32"] for p in parts.values()),
           "parts": parts}
    out.update(extra)
    return out


def decode_cost(args: ModelArgs, batch: int, context: int, dtype=torch.float32) -> dict:
    """Cost of one decode step: ``batch`` sequences, each with ``context`` tokens in its state.

    Args:
        args: the model's ``ModelArgs``. dtype: compute dtype (torch dtype, name, or bytes per
            compute-dtype parameter); KV state is in it too, compressor remainders are fp32.
    Returns:
        ``{"bytes", "flops", "flops_fp32", "parts": {part: {"bytes", "flops", "flops_fp32"}},
        "experts_touched"}``; ``flops_fp32`` is the part done on fp32 weights in a bf16 model
        (0 when the compute dtype is fp32). See the module docstring for every term.
    """
    if batch <= 0 or context < 0:
        raise ValueError(f"decode_cost: batch must be > 0 and context >= 0, got {batch}, {context}")
    cb = dtype_bytes(dtype)
    B, C = batch, context
    parts = _weight_terms(args, cb, tokens=B, weight_reads=1, expert_tokens=[B], embed_rows=B, head_rows=B)
    # hash layers look up tid2eid[token]: k int64 per token and layer
    _add(parts, "router", B * args.num_hash_layers * args.num_experts_per_tok * 8)
    d, nh, W = args.head_dim, args.num_attention_heads, args.sliding_window
    hI, dI, kI = args.index_n_heads, args.index_head_dim, args.index_topk
    attn_key = 4 * nh * d                                            # QK + PV FLOPs per key
    for i in range(args.num_hidden_layers):
        r = args.compress_ratios[i]
        hist = min(C, W - 1)
        _add(parts, "state_window", B * (hist + 1) * d * cb, B * attn_key * (hist + 1))
        if r == HCA_RATIO:
            nc = (C + 1) // HCA_RATIO
            _add(parts, "state_hca", B * nc * d * cb, B * attn_key * nc)
        if r == CSA_RATIO:
            n4 = (C + 1) // CSA_RATIO
            sel = min(kI, n4)
            _add(parts, "state_csa", B * sel * d * cb, B * attn_key * sel)
            _add(parts, "state_indexer", B * n4 * dI * cb, B * n4 * (2 * hI * dI + 2 * hI))
        # compressor remainders: kv + score rows (fp32, width c*dim) written, read at close; entries written
        comps = [] if not r else [(r, d)] + ([(CSA_RATIO, dI)] if r == CSA_RATIO else [])
        for m, dim in comps:
            width = (2 if m == CSA_RATIO else 1) * dim
            _add(parts, "state_compressor", B * (2 * 2 * width * 4 + dim * cb / m))
    return _finish(parts, experts_touched=expected_distinct_experts(args.n_routed_experts,
                                                                    args.num_experts_per_tok, B))


def _sum_floor(J: int, m: int) -> int:
    """``sum_{j=1}^{J} floor(j / m)``."""
    if J <= 0:
        return 0
    q, r = divmod(J, m)
    return m * q * (q - 1) // 2 + q * (r + 1)


def _sum_min_floor(T: int, m: int, cap: int) -> int:
    """``sum_{j=1}^{T} min(cap, floor(j / m))``."""
    J = min(T, m * cap - 1)
    return _sum_floor(J, m) + max(0, T - J) * cap


def prefill_cost(args: ModelArgs, length: int, dtype=torch.float32, chunk: int = 8192) -> dict:
    """Cost of prefilling one ``length``-token prompt from an empty state in chunks of ``chunk``,
    then the LM head on the last row. Returns the same dict as ``decode_cost`` plus ``keys``:
    summed attended keys per layer kind (window, csa, hca, indexer)."""
    if length <= 0 or chunk <= 0:
        raise ValueError(f"prefill_cost: length and chunk must be > 0, got {length}, {chunk}")
    cb = dtype_bytes(dtype)
    T = length
    sizes = [min(chunk, T - s) for s in range(0, T, chunk)]
    parts = _weight_terms(args, cb, tokens=T, weight_reads=len(sizes), expert_tokens=sizes, embed_rows=T,
                          head_rows=1)
    _add(parts, "router", T * args.num_hash_layers * args.num_experts_per_tok * 8)
    d, nh, W = args.head_dim, args.num_attention_heads, args.sliding_window
    hI, dI, kI = args.index_n_heads, args.index_head_dim, args.index_topk
    attn_key = 4 * nh * d
    keys = {"window": T * W - W * (W - 1) // 2 if T >= W else T * (T + 1) // 2,
            "csa": _sum_min_floor(T, CSA_RATIO, kI),
            "hca": _sum_floor(T, HCA_RATIO),
            "indexer": _sum_floor(T, CSA_RATIO)}
    ends = [sum(sizes[:i]) for i in range(len(sizes))]             # tokens before each chunk
    for i in range(args.num_hidden_layers):
        r = args.compress_ratios[i]
        _add(parts, "state_window", min(T, W) * d * cb, attn_key * keys["window"])
        if r == HCA_RATIO:
            _add(parts, "state_hca", (T // HCA_RATIO + sum(e // HCA_RATIO for e in ends)) * d * cb,
                 attn_key * keys["hca"])
        if r == CSA_RATIO:
            _add(parts, "state_csa", (T // CSA_RATIO + sum(e // CSA_RATIO for e in ends)) * d * cb,
                 attn_key * keys["csa"])
            _add(parts, "state_indexer", (T // CSA_RATIO + sum(e // CSA_RATIO for e in ends)) * dI * cb,
                 (2 * hI * dI + 2 * hI) * keys["indexer"])
    return _finish(parts, keys=keys, chunks=len(sizes))


# ---- the limit ---------------------------------------------------------------------------------
def limit(cost: dict, hw: dict, dtype=torch.float32) -> dict:
    """Hardware floor of a step: ``max(bytes / read bandwidth, flops / GEMM peak)``.

    FLOPs on fp32 weights in a bf16 model (``cost["flops_fp32"]``) run at the fp32 peak, the rest
    at the compute dtype's peak. Returns ``{"limit_s", "memory_s", "compute_s", "bound"}`` with
    ``bound`` "memory" or "compute" (whichever term is larger).
    """
    peaks = hw["gemm_gflops"]
    mem_s = cost["bytes"] / (hw["read_gbs"] * GB)
    other = cost["flops"] - cost["flops_fp32"]
    comp_s = cost["flops_fp32"] / (peaks["float32"] * GB) + other / (peaks[dtype_name(dtype)] * GB)
    return {"limit_s": max(mem_s, comp_s), "memory_s": mem_s, "compute_s": comp_s,
            "bound": "memory" if mem_s >= comp_s else "compute"}
