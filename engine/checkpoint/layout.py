"""The on-disk layout of an original DeepSeek-V4 checkpoint: every tensor's name, shape, dtype.

One table (reference/dsv4-architecture.md §2.2) derived from ``ModelArgs``; the loader checks a
checkpoint against it and ``dsv4-make-tiny`` writes exactly it. Names carry no ``model.`` prefix
and are also the parameter names of ``engine.model`` (experts are stacked there).

Storage kinds (§2.1):
  ``bf16`` / ``f32`` / ``i64``  plain tensors
  ``fp8``   ``X.weight`` float8_e4m3fn ``[out, in]`` + ``X.scale`` e8m0 ``[ceil(out/bo), ceil(in/bi)]``
  ``fp4``   ``X.weight`` int8 ``[out, in/2]`` + ``X.scale`` e8m0 ``[out, in/32]``
Converted checkpoints (§7, ``dsv4-convert-model``) store some linears in another format;
``engine.checkpoint.qscheme`` says which. Each stored linear ``X`` keeps its name:

==========  =========================  ===========================  ==============================
format      X.weight                   X.scale                      rule (codec module)
==========  =========================  ===========================  ==============================
int8        int8 ``[N, K]``            fp32 ``[N, 1]``              ``s = absmax_row / 127``
                                                                    (``int8_int4``)
int4        int8 ``[N/2, K]`` (2 rows  uint64 ``[N, 1]`` (fp32 bits ``s`` from a clip search
            per byte: row 2j low)      in the low 32 bits)          0.70..1.30; ``X.bias [N]``
                                                                    (``int8_int4``)
mxfp8       float8_e4m3fn ``[N, K]``   uint8 e8m0 ``[N, K/32]``     shared exp - 8, e4m3 (``mx``)
mxfp4       uint8 ``[N, K/2]`` (2      uint8 e8m0 ``[N, K/32]``     shared exp - 2, e2m1 (``mx``)
            cols per byte: even low)
hif8        uint8 HiF8 ``[N, K]``      fp32 ``[N, 1]``              per-row HiFloat8 (``hif8``)
==========  =========================  ===========================  ==============================
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.checkpoint.qscheme import linear_format
from engine.config import CSA_RATIO, ModelArgs

# safetensors dtype strings
BF16, F32, I64, F8, E8M0, I8, U8, U64 = "BF16", "F32", "I64", "F8_E4M3", "F8_E8M0", "I8", "U8", "U64"
ITEMSIZE = {BF16: 2, F32: 4, I64: 8, F8: 1, E8M0: 1, I8: 1, U8: 1, U64: 8}   # bytes per stored element


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor: safetensors dtype string and shape."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in a shard file (elements x the dtype's size)."""
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class LinearSpec:
    """A linear weight ``[out, in]`` and how it is stored (``bf16``, ``fp8`` or ``fp4``)."""

    out_features: int
    in_features: int
    kind: str


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def linear_tensors(name: str, lin: LinearSpec, args: ModelArgs) -> dict[str, TensorSpec]:
    """Stored tensors of one linear ``name`` (without the ``.weight`` suffix)."""
    n, k = lin.out_features, lin.in_features
    if lin.kind == "bf16":
        return {f"{name}.weight": TensorSpec(BF16, (n, k))}
    if lin.kind == "fp8":
        bo, bi = args.quant.weight_block_size
        return {f"{name}.weight": TensorSpec(F8, (n, k)), f"{name}.scale": TensorSpec(E8M0, (_cdiv(n, bo), _cdiv(k, bi)))}
    if lin.kind == "fp4":
        return {f"{name}.weight": TensorSpec(I8, (n, k // 2)), f"{name}.scale": TensorSpec(E8M0, (n, k // 32))}
    if lin.kind in ("int8", "hif8"):
        return {f"{name}.weight": TensorSpec(I8 if lin.kind == "int8" else U8, (n, k)),
                f"{name}.scale": TensorSpec(F32, (n, 1))}
    if lin.kind == "int4":
        return {f"{name}.weight": TensorSpec(I8, (n // 2, k)), f"{name}.scale": TensorSpec(U64, (n, 1)),
                f"{name}.bias": TensorSpec(F32, (n,))}
    if lin.kind in ("mxfp8", "mxfp4"):
        w = TensorSpec(F8, (n, k)) if lin.kind == "mxfp8" else TensorSpec(U8, (n, k // 2))
        return {f"{name}.weight": w, f"{name}.scale": TensorSpec(U8, (n, k // 32))}
    raise ValueError(f"unknown linear kind {lin.kind!r}")


def block_linears(args: ModelArgs, prefix: str, ratio: int) -> dict[str, LinearSpec]:
    """Linear layers of one decoder block (backbone or MTP) keyed by full name."""
    q8 = "fp8" if args.quant else "bf16"
    ex = ("fp4" if args.quant.expert_dtype == "fp4" else "fp8") if args.quant else "bf16"
    H, d, nh, G = args.hidden_size, args.head_dim, args.num_attention_heads, args.o_groups
    a = f"{prefix}.attn"
    lin = {
        f"{a}.wq_a": LinearSpec(args.q_lora_rank, H, q8),
        f"{a}.wq_b": LinearSpec(nh * d, args.q_lora_rank, q8),
        f"{a}.wkv": LinearSpec(d, H, q8),
        f"{a}.wo_a": LinearSpec(G * args.o_lora_rank, nh * d // G, q8),
        f"{a}.wo_b": LinearSpec(H, G * args.o_lora_rank, q8),
    }
    if ratio:
        coff = 2 if ratio == CSA_RATIO else 1
        lin[f"{a}.compressor.wkv"] = LinearSpec(coff * d, H, "bf16")
        lin[f"{a}.compressor.wgate"] = LinearSpec(coff * d, H, "bf16")
    if ratio == CSA_RATIO:
        dI = args.index_head_dim
        lin[f"{a}.indexer.wq_b"] = LinearSpec(args.index_n_heads * dI, args.q_lora_rank, q8)
        lin[f"{a}.indexer.weights_proj"] = LinearSpec(args.index_n_heads, H, "bf16")
        lin[f"{a}.indexer.compressor.wkv"] = LinearSpec(2 * dI, H, "bf16")
        lin[f"{a}.indexer.compressor.wgate"] = LinearSpec(2 * dI, H, "bf16")
    f = f"{prefix}.ffn"
    lin[f"{f}.gate"] = LinearSpec(args.n_routed_experts, H, "bf16")
    inter = args.moe_intermediate_size
    if args.n_shared_experts:
        si = inter * args.n_shared_experts
        lin[f"{f}.shared_experts.w1"] = LinearSpec(si, H, q8)
        lin[f"{f}.shared_experts.w3"] = LinearSpec(si, H, q8)
        lin[f"{f}.shared_experts.w2"] = LinearSpec(H, si, q8)
    for e in range(args.n_routed_experts):
        lin[f"{f}.experts.{e}.w1"] = LinearSpec(inter, H, ex)
        lin[f"{f}.experts.{e}.w3"] = LinearSpec(inter, H, ex)
        lin[f"{f}.experts.{e}.w2"] = LinearSpec(H, inter, ex)
    return lin


def block_plain(args: ModelArgs, prefix: str, ratio: int, hash_layer: bool) -> dict[str, TensorSpec]:
    """Non-linear tensors (norms, mHC, sinks, ape, router bias / tid2eid) of one block."""
    H, hc, d = args.hidden_size, args.hc_mult, args.head_dim
    mix = (2 + hc) * hc
    t = {
        f"{prefix}.attn_norm.weight": TensorSpec(BF16, (H,)),
        f"{prefix}.ffn_norm.weight": TensorSpec(BF16, (H,)),
        f"{prefix}.attn.q_norm.weight": TensorSpec(BF16, (args.q_lora_rank,)),
        f"{prefix}.attn.kv_norm.weight": TensorSpec(BF16, (d,)),
        f"{prefix}.attn.attn_sink": TensorSpec(F32, (args.num_attention_heads,)),
    }
    for site in ("attn", "ffn"):
        t[f"{prefix}.hc_{site}_fn"] = TensorSpec(F32, (mix, hc * H))
        t[f"{prefix}.hc_{site}_base"] = TensorSpec(F32, (mix,))
        t[f"{prefix}.hc_{site}_scale"] = TensorSpec(F32, (3,))
    if ratio:
        coff = 2 if ratio == CSA_RATIO else 1
        t[f"{prefix}.attn.compressor.ape"] = TensorSpec(F32, (ratio, coff * d))
        t[f"{prefix}.attn.compressor.norm.weight"] = TensorSpec(BF16, (d,))
    if ratio == CSA_RATIO:
        dI = args.index_head_dim
        t[f"{prefix}.attn.indexer.compressor.ape"] = TensorSpec(F32, (CSA_RATIO, 2 * dI))
        t[f"{prefix}.attn.indexer.compressor.norm.weight"] = TensorSpec(BF16, (dI,))
    if hash_layer:
        t[f"{prefix}.ffn.gate.tid2eid"] = TensorSpec(I64, (args.vocab_size, args.num_experts_per_tok))
    else:
        t[f"{prefix}.ffn.gate.bias"] = TensorSpec(F32, (args.n_routed_experts,))
    return t


def model_linears(args: ModelArgs) -> dict[str, LinearSpec]:
    """Every linear of the checkpoint (backbone, head, MTP), in the storage its config names."""
    lin: dict[str, LinearSpec] = {}
    for i in range(args.num_hidden_layers):
        lin.update(block_linears(args, f"layers.{i}", args.compress_ratios[i]))
    q8 = "fp8" if args.quant else "bf16"
    for j in range(args.num_mtp_layers):
        p = f"mtp.{j}"
        lin.update(block_linears(args, p, 0))
        lin[f"{p}.e_proj"] = LinearSpec(args.hidden_size, args.hidden_size, q8)
        lin[f"{p}.h_proj"] = LinearSpec(args.hidden_size, args.hidden_size, q8)
    lin["head"] = LinearSpec(args.vocab_size, args.hidden_size, "bf16")
    qt = args.quant.quant_type if args.quant else None
    return {n: LinearSpec(s.out_features, s.in_features, linear_format(qt, n, s.kind)) for n, s in lin.items()}


def checkpoint_layout(args: ModelArgs) -> dict[str, TensorSpec]:
    """Every stored tensor of the checkpoint ``args`` describes: name -> TensorSpec."""
    H = args.hidden_size
    t: dict[str, TensorSpec] = {"embed.weight": TensorSpec(BF16, (args.vocab_size, H)),
                                "norm.weight": TensorSpec(BF16, (H,))}
    t.update(_hc_head("", args))
    for i in range(args.num_hidden_layers):
        t.update(block_plain(args, f"layers.{i}", args.compress_ratios[i], args.is_hash_layer(i)))
    for j in range(args.num_mtp_layers):
        p = f"mtp.{j}"
        t.update(block_plain(args, p, 0, False))
        for n in ("enorm", "hnorm", "norm"):
            t[f"{p}.{n}.weight"] = TensorSpec(BF16, (H,))
        t.update(_hc_head(f"{p}.", args))
    for name, lin in model_linears(args).items():
        t.update(linear_tensors(name, lin, args))
    return t


def _hc_head(prefix: str, args: ModelArgs) -> dict[str, TensorSpec]:
    hc = args.hc_mult
    return {f"{prefix}hc_head_fn": TensorSpec(F32, (hc, hc * args.hidden_size)),
            f"{prefix}hc_head_base": TensorSpec(F32, (hc,)),
            f"{prefix}hc_head_scale": TensorSpec(F32, (1,))}
