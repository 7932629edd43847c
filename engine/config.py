"""Model configuration: the checkpoint's config.json, read and checked.

Field names are the real config.json keys of DeepSeek-V4-Flash / -Pro
(reference/dsv4-architecture.md §1.1), so ``ModelArgs.from_json(path)`` reads a published
checkpoint as is. Every missing or inconsistent field raises ``ConfigError`` naming the
field and what was expected.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.checkpoint.qscheme import parse_compressed_tensors

log = logging.getLogger(__name__)

SWA, CSA, HCA = "swa", "csa", "hca"
CSA_RATIO, HCA_RATIO = 4, 128
_RATIO_KIND = {0: SWA, CSA_RATIO: CSA, HCA_RATIO: HCA}

# Keys a real config.json carries that the model does not need.
_INFORMATIONAL_KEYS = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "auto_map",
    "initializer_range", "use_cache", "attention_bias", "attention_dropout", "pad_token_id",
    "n_group", "topk_group", "first_k_dense_replace", "moe_layer_freq", "ep_size",
    "_name_or_path", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "rope_interleave",
    "num_experts_per_tok_hash", "mlp_bias", "output_router_logits", "router_aux_loss_coef",
    "router_jitter_noise", "aux_loss_alpha", "seq_aux", "intermediate_size",
}


class ConfigError(ValueError):
    """A config field is missing, mistyped or inconsistent. The message names the field."""


@dataclass(frozen=True)
class FP8Quant:
    """``quantization_config`` of the original Hybrid FP8-MXFP4 checkpoints (§1.1, §2.1).

    Dense linears: e4m3 weights with ue8m0 block scales of ``weight_block_size`` (rows, cols).
    Routed experts: ``expert_dtype`` "fp4" (packed e2m1 x2 in int8, ue8m0 scale per 32 inputs)
    or "fp8" (same layout as dense linears).
    """

    weight_block_size: tuple[int, int] = (128, 128)
    expert_dtype: str = "fp4"
    fmt: str = "e4m3"
    scale_fmt: str = "ue8m0"
    activation_scheme: str = "dynamic"
    # converted layout (§7; engine.checkpoint.qscheme.QUANT_TYPES) or None for the original tensors
    quant_type: str | None = None
    # a compressed-tensors quantization_config (§1.3), kept as read and written back by to_dict
    compressed: dict | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ModelArgs:
    """DeepSeek-V4 hyper-parameters; field names equal config.json keys (§1.1)."""

    # vocab / trunk
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    eos_token_id: int
    # attention (shared-KV MQA, q-LoRA, grouped output projection)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    # compression (CSA / HCA) and the lightning indexer
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # rope
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: dict | None
    # moe
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    num_hash_layers: int
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # mtp
    num_nextn_predict_layers: int = 0
    # storage
    quant: FP8Quant | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------------
    def layer_kind(self, i: int) -> str:
        """'swa', 'csa' or 'hca' for backbone layer i (MTP layers: index >= num_hidden_layers)."""
        return _RATIO_KIND[self.compress_ratios[i]]

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    def is_hash_layer(self, i: int) -> bool:
        return i < self.num_hash_layers

    def overridden(self, num_hidden_layers: int | None = None,
                   max_position_embeddings: int | None = None) -> "ModelArgs":
        """These args under ``model_config.custom_params``' overrides (§5.1): the first
        ``num_hidden_layers`` backbone layers (their compress ratios and hash routing; the MTP
        layers kept) and another ``max_position_embeddings``. None keeps a value.
        Raises ConfigError: more layers than the checkpoint has."""
        n, out = self.num_hidden_layers, self
        if num_hidden_layers is not None and num_hidden_layers != n:
            if not 0 < num_hidden_layers <= n:
                raise ConfigError(f"model_config.custom_params.num_hidden_layers: must be 1..{n} (the checkpoint's "
                                  f"num_hidden_layers), got {num_hidden_layers}")
            k = num_hidden_layers
            out = dataclasses.replace(out, num_hidden_layers=k, num_hash_layers=min(self.num_hash_layers, k),
                                      compress_ratios=self.compress_ratios[:k] + self.compress_ratios[n:])
        if max_position_embeddings is not None:
            out = dataclasses.replace(out, max_position_embeddings=max_position_embeddings)
        out.validate()
        return out

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_json(cls, path: str | Path) -> "ModelArgs":
        """Read ``config.json`` (a file or a checkpoint directory).

        Raises:
            ConfigError: missing file, invalid JSON, or any field check below fails.
        """
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ConfigError(f"config.json: not found at {p}")
        return cls.from_dict(read_json_object(p, ConfigError))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelArgs":
        """Build and validate from a config.json dict. Raises ConfigError."""
        raw = dict(raw)
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in ("quant", "extra"):
                continue
            if f.name in raw:
                kw[f.name] = _check_type(f.name, raw.pop(f.name), f.type)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"config.json: missing required field '{f.name}'")
        if "eos_token_id" in kw and isinstance(kw["eos_token_id"], list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        kw["compress_ratios"] = tuple(kw["compress_ratios"])
        top_expert_dtype = raw.pop("expert_dtype", None)
        kw["quant"] = _parse_quant(raw.pop("quantization_config", None), top_expert_dtype)
        unknown = sorted(k for k in raw if k not in _INFORMATIONAL_KEYS)
        if unknown:
            log.warning("config.json: ignoring unknown fields %s", unknown)
        args = cls(**kw, extra=raw)
        args.validate()
        return args

    def to_dict(self) -> dict[str, Any]:
        """The config.json form (inverse of from_dict)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("quant", "extra")}
        d["compress_ratios"] = list(self.compress_ratios)
        q = self.quant
        if q is not None:
            d["quantization_config"] = q.compressed if q.compressed is not None else {
                "quant_method": "fp8", "fmt": q.fmt, "activation_scheme": q.activation_scheme,
                "scale_fmt": q.scale_fmt, "weight_block_size": list(q.weight_block_size),
            }
            d["expert_dtype"] = q.expert_dtype
        return {**self.extra, **d}

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        """Check ranges and cross-field consistency. Raises ConfigError naming the field."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                     "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
                     "num_experts_per_tok", "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: '{name}' must be > 0, found {getattr(self, name)}")
        for name in ("num_hash_layers", "num_nextn_predict_layers", "n_shared_experts"):
            if getattr(self, name) < 0:
                raise ConfigError(f"config.json: '{name}' must be >= 0, found {getattr(self, name)}")
        _expect(self.num_key_value_heads == 1, "num_key_value_heads", "1 (shared-KV MQA)", self.num_key_value_heads)
        _expect(self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim <= self.head_dim, "qk_rope_head_dim",
                f"an even number <= head_dim ({self.head_dim})", self.qk_rope_head_dim)
        _expect(self.qk_rope_head_dim <= self.index_head_dim, "index_head_dim",
                f">= qk_rope_head_dim ({self.qk_rope_head_dim})", self.index_head_dim)
        _expect(self.num_attention_heads % self.o_groups == 0, "o_groups",
                f"a divisor of num_attention_heads ({self.num_attention_heads})", self.o_groups)
        _expect(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
                f"<= n_routed_experts ({self.n_routed_experts})", self.num_experts_per_tok)
        _expect(self.num_hash_layers <= self.num_hidden_layers, "num_hash_layers",
                f"<= num_hidden_layers ({self.num_hidden_layers})", self.num_hash_layers)
        n_ratios = self.num_hidden_layers + self.num_nextn_predict_layers
        _expect(len(self.compress_ratios) in (n_ratios, self.num_hidden_layers), "compress_ratios",
                f"{n_ratios} entries (num_hidden_layers + num_nextn_predict_layers)", len(self.compress_ratios))
        bad = [r for r in self.compress_ratios if r not in _RATIO_KIND]
        _expect(not bad, "compress_ratios", "entries in {0, 4, 128}", bad)
        mtp_ratios = self.compress_ratios[self.num_hidden_layers:]
        _expect(all(r == 0 for r in mtp_ratios), "compress_ratios",
                "0 (window-only) for the trailing MTP entries", list(mtp_ratios))
        _expect(self.scoring_func == "sqrtsoftplus", "scoring_func", "'sqrtsoftplus'", self.scoring_func)
        _expect(self.topk_method == "noaux_tc", "topk_method", "'noaux_tc'", self.topk_method)
        _expect(self.norm_topk_prob is True, "norm_topk_prob", "true", self.norm_topk_prob)
        _expect(self.hidden_act == "silu", "hidden_act", "'silu'", self.hidden_act)
        _expect(not self.tie_word_embeddings, "tie_word_embeddings", "false", self.tie_word_embeddings)
        _range("routed_scaling_factor", self.routed_scaling_factor, 0, 1e3)
        _range("swiglu_limit", self.swiglu_limit, 0, 1e4)
        _range("rms_norm_eps", self.rms_norm_eps, 0, 0.1)
        _range("hc_eps", self.hc_eps, 0, 0.1)
        _range("rope_theta", self.rope_theta, 1, 1e12)
        _range("compress_rope_theta", self.compress_rope_theta, 1, 1e12)
        _expect(self.max_position_embeddings <= 1 << 31, "max_position_embeddings", "<= 2^31",
                self.max_position_embeddings)
        _expect(self.sliding_window <= self.max_position_embeddings, "sliding_window",
                f"<= max_position_embeddings ({self.max_position_embeddings})", self.sliding_window)
        _expect(self.index_topk <= self.max_position_embeddings // 4, "index_topk",
                f"<= max_position_embeddings / 4 ({self.max_position_embeddings // 4})", self.index_topk)
        for name in ("eos_token_id", "bos_token_id"):
            _expect(0 <= getattr(self, name) < self.vocab_size, name, f"in [0, vocab_size={self.vocab_size})",
                    getattr(self, name))
        if self.rope_scaling is not None:
            _validate_yarn(self.rope_scaling)


def read_text_file(path: str | Path, error: type[Exception], what: str) -> str:
    """A UTF-8 text file; ``error`` naming the file and ``what`` it is when missing or unreadable."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{p}: {what} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{p}: cannot read {what}: {e}") from None


def read_json_object(path: Path, error: type[Exception]) -> dict:
    """A JSON file that must hold an object; ``error`` (naming the file) otherwise."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path.name}: invalid JSON at {path}: {e}") from None
    if not isinstance(raw, dict):
        raise error(f"{path.name}: expected a JSON object at {path}, found {type(raw).__name__}")
    return raw


def _expect(ok: bool, name: str, expected: str, found: Any) -> None:
    if not ok:
        raise ConfigError(f"config.json: '{name}' must be {expected}, found {found!r}")


def _range(name: str, value: float, lo: float, hi: float) -> None:
    _expect(lo < value <= hi, name, f"in ({lo:g}, {hi:g}]", value)


def _check_type(name: str, value: Any, annotation: Any) -> Any:
    ann = str(annotation)
    if ann.startswith("int") and not ann.startswith("int |"):
        if name == "eos_token_id" and isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            return value
        ok = isinstance(value, int) and not isinstance(value, bool)
        _expect(ok, name, "an integer", value)
    elif ann.startswith("float"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        _expect(ok, name, "a finite number", value)
        value = float(value)
    elif ann.startswith("bool"):
        _expect(isinstance(value, bool), name, "true or false", value)
    elif ann.startswith("str"):
        _expect(isinstance(value, str), name, "a string", value)
    elif ann.startswith("tuple"):
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        _expect(ok, name, "a list of integers", value)
    elif ann.startswith("dict"):
        _expect(value is None or isinstance(value, dict), name, "an object or null", value)
    return value


def _validate_yarn(rs: dict) -> None:
    kind = rs.get("type", rs.get("rope_type"))
    _expect(kind == "yarn", "rope_scaling.type", "'yarn'", kind)
    for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
        v = rs.get(k)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e12
        _expect(ok, f"rope_scaling.{k}", "a positive finite number", v)
    _expect(rs["factor"] >= 1, "rope_scaling.factor", ">= 1", rs["factor"])
    _expect(rs["beta_fast"] > rs["beta_slow"], "rope_scaling.beta_fast", f"> beta_slow ({rs['beta_slow']})",
            rs["beta_fast"])


def _parse_quant(qc: Any, top_expert_dtype: Any) -> FP8Quant | None:
    if qc is None:
        _expect(top_expert_dtype is None, "expert_dtype", "absent without quantization_config", top_expert_dtype)
        return None
    _expect(isinstance(qc, dict), "quantization_config", "an object", qc)
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        try:
            quant_type, block = parse_compressed_tensors(qc)
        except ValueError as e:
            raise ConfigError(f"config.json: {e}") from None
        expert_dtype = top_expert_dtype or "fp4"
        _expect(expert_dtype in ("fp4", "fp8"), "expert_dtype", "'fp4' or 'fp8'", expert_dtype)
        return FP8Quant(weight_block_size=block, expert_dtype=expert_dtype, quant_type=quant_type, compressed=qc)
    _expect(method == "fp8", "quantization_config.quant_method",
            "'fp8' (original Hybrid FP8-MXFP4) or 'compressed-tensors' (dsv4-convert-config / -model)", method)
    fmt = qc.get("fmt", "e4m3")
    _expect(fmt == "e4m3", "quantization_config.fmt", "'e4m3'", fmt)
    scale_fmt = qc.get("scale_fmt", "ue8m0")
    _expect(scale_fmt == "ue8m0", "quantization_config.scale_fmt", "'ue8m0'", scale_fmt)
    wbs = qc.get("weight_block_size", [128, 128])
    ok = isinstance(wbs, list) and len(wbs) == 2 and all(isinstance(v, int) and v > 0 for v in wbs)
    _expect(ok, "quantization_config.weight_block_size", "two positive integers", wbs)
    expert_dtype = qc.get("expert_dtype", top_expert_dtype) or "fp4"
    _expect(expert_dtype in ("fp4", "fp8"), "expert_dtype", "'fp4' or 'fp8'", expert_dtype)
    return FP8Quant(weight_block_size=(wbs[0], wbs[1]), expert_dtype=expert_dtype, fmt=fmt, scale_fmt=scale_fmt,
                    activation_scheme=qc.get("activation_scheme", "dynamic"))
