"""A contract stub of the Ascend runtime, so the NPU op table runs on CPU tensors for an op census.

What it is: ``install()`` puts a stub ``torch_npu`` module and a stub ``custom_ops`` module in
``sys.modules`` (building the latter registers every ``custom.*`` API of
``engine.ops.npu.KERNEL_APIS`` under ``torch.ops.custom`` with ``torch.library``, as the real
package's import does) and makes ``engine.ops.npu.runtime`` count CPU tensors as NPU tensors
(its ``NPU_DEVICE_TYPES`` seam). Then ``ops_for("npu")`` installs every wrapper, and a model run
through that table takes each wrapper's real decision: kernel path or fallback. The returned
``StubRuntime`` records both: ``calls`` gets one ``StubCall(api, {arg: (shape, dtype)})`` per
kernel call (tensor arguments only; a tensor list's items as ``name[i]``), and ``fallbacks`` one
``(op, reason)`` per call that fell back (the ``FALLBACK_OBSERVERS`` seam: the log says each
reason once, the census needs every call).

Each API accepts exactly its schema's arguments: the ``custom.*`` ones are ``torch.library`` ops
defined by the [CRI] ``ops_def_registration.cpp`` schemas, the ``torch_npu.*`` ones bind against the
[OPP] ``op_plugin_functions.yaml`` schemas (unknown or missing arguments raise ``TypeError``). The
kernels (``bench.npu_stub_kernels``) check the documented contract and raise ``ContractError``
outside it, so a wrapper that hands a kernel the wrong dtype or layout fails loudly here.

What each stub returns (shapes and dtypes as documented; see ``bench.npu_stub_kernels``):

* real values, from the doc's formula or golden, in fp32 then cast: ``npu_rms_norm``,
  ``npu_transpose_batchmatmul``, ``npu_clipped_swiglu``, ``npu_moe_init_routing_v2``,
  ``npu_grouped_matmul`` (float and W8A8), ``npu_moe_finalize_routing``, ``npu_dynamic_quant``,
  ``npu_quant_matmul``, ``inplace_partial_rotary_mul`` (in place), ``npu_moe_gating_top_k``, the
  cache epilogues ``kv_compress_epilog`` / ``indexer_compress_epilog`` / ``scatter_nd_update_asc``
  (in place) and ``npu_quant_lightning_indexer`` (-1 padded ids); ``npu_hc_pre`` / ``npu_hc_post``
  run the reference op (same arguments);
* placeholders: ``npu_sparse_attn_sharedkv`` returns zeros ``[T, 64, 512]`` in q's dtype (so
  attention contributes nothing and later values are not the model's), and both ``*_metadata``
  ops 1024 int32 zeros.

Limits: a contract stub, not numerics. Real values round like the reference's fp32 maths, not like
the kernels (accumulation order, fp32 softplus, tie order); nothing here measures time. A graph
tracer sees the ``custom.*`` ops through fake impls (the stub kernel run on zeros of the traced
shapes: its contract checks hold, outputs keep their shapes and dtypes), so a traced step counts
its own graph breaks; the ``torch_npu.*`` stubs are plain functions, whose breaks the census counts
apart. A compiled graph would bake the Python stubs in: fallbacks are not observed while compiling. CPU tensors only ("cpu" is added to ``NPU_DEVICE_TYPES``; CUDA tensors still fall
back). Modes of a kernel that no wrapper uses raise ``NotImplementedError``. Nothing on the
wrappers' kernel path reaches ``torch.npu``, streams or NPU tensor formats: the only device-derived
value is ``str(q.device)`` given to the metadata ops' ``device`` argument, which the stubs ignore;
so the stub ``torch_npu`` holds the eight kernel functions and nothing else.

``uninstall()`` restores ``sys.modules``, ``NPU_DEVICE_TYPES`` and ``FALLBACK_OBSERVERS``. The
``torch.library`` registrations stay for the life of the process (torch.library has no public way
to drop a defined op; a later ``install()`` reuses them, and between installs the kernels run but
record nothing), and so do ``runtime.api_available``'s cached answers. Callers that need a clean
process run the stub in a subprocess (tests/bench/test_npu_stub.py does).

Usage::

    from bench import npu_stub
    rt = npu_stub.install()
    ops = engine.ops.ops_for("npu")        # every mapped op on its NPU wrapper
    model = engine.checkpoint.loader.load_model(path, dtype=torch.bfloat16, ops=ops)   # CPU tensors
    model.forward(tokens, model.new_state())
    rt.kernel_counts(), rt.fallback_counts()
    npu_stub.uninstall()
"""
from __future__ import annotations

import sys
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from bench import npu_stub_kernels as K
from bench.npu_stub_kernels import ContractError
from engine.ops.npu import KERNEL_APIS, runtime

__all__ = ["SCHEMAS", "ContractError", "StubCall", "StubKernel", "StubRuntime", "install", "kernels", "tensor_args",
           "uninstall"]

# [OPP] op_plugin/config/op_plugin_functions.yaml and [CRI] ops_def_registration.cpp, as published.
SCHEMAS: dict[str, str] = {
    "torch_npu.npu_rms_norm": "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "torch_npu.npu_transpose_batchmatmul":
        "npu_transpose_batchmatmul(Tensor input, Tensor weight, *, Tensor? bias=None, Tensor? scale=None, "
        "int[]? perm_x1=None, int[]? perm_x2=None, int[]? perm_y=None, int? batch_split_factor=1) -> Tensor",
    "torch_npu.npu_clipped_swiglu":
        "npu_clipped_swiglu(Tensor x, *, Tensor? group_index=None, int dim=-1, float alpha=1.702, "
        "float limit=7.0, float bias=1.0, bool interleaved=True) -> Tensor",
    "torch_npu.npu_moe_init_routing_v2":
        "npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
        "int active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, "
        "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=-1, "
        "int[2] active_expert_range=[], int row_idx_type=0, int? x_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)",
    "torch_npu.npu_grouped_matmul":
        "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
        "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
        "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
        "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
        "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
        "int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, "
        "int? per_token_scale_dtype=None) -> Tensor[]",
    "torch_npu.npu_moe_finalize_routing":
        "npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, "
        "Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, int? drop_pad_mode=0, "
        "int? k=1) -> Tensor",
    "torch_npu.npu_dynamic_quant":
        "npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, "
        "int? dst_type=None, str quant_mode=\"pertoken\", float dst_type_max=0.0) -> (Tensor, Tensor)",
    "torch_npu.npu_quant_matmul":
        "npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, Tensor? pertoken_scale=None, "
        "Tensor? bias=None, int? output_dtype=None, int? x1_dtype=None, int? x2_dtype=None, "
        "int? pertoken_scale_dtype=None, int? scale_dtype=None, int[]? group_sizes=None, "
        "Tensor? y_scale=None) -> Tensor",
    "custom.inplace_partial_rotary_mul":
        "inplace_partial_rotary_mul(Tensor(a!) x, Tensor r1, Tensor r2, *, str rotary_mode, "
        "int[2] partial_slice) -> ()",
    "custom.npu_hc_pre":
        "npu_hc_pre(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, *, int hc_mult=4, "
        "int hc_sinkhorn_iters=20, float norm_eps=1e-6, float hc_eps=1e-6) -> (Tensor, Tensor, Tensor)",
    "custom.npu_hc_post": "npu_hc_post(Tensor x, Tensor residual, Tensor post, Tensor comb) -> Tensor",
    "custom.npu_sparse_attn_sharedkv":
        "npu_sparse_attn_sharedkv(Tensor q, *, Tensor? ori_kv=None, Tensor? cmp_kv=None, "
        "Tensor? ori_sparse_indices=None, Tensor? cmp_sparse_indices=None, Tensor? ori_block_table=None, "
        "Tensor? cmp_block_table=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, "
        "Tensor? cu_seqlens_cmp_kv=None, Tensor? seqused_q=None, Tensor? seqused_kv=None, Tensor? sinks=None, "
        "Tensor? metadata=None, float softmax_scale=0, int cmp_ratio=0, int ori_mask_mode=4, "
        "int cmp_mask_mode=3, int ori_win_left=127, int ori_win_right=0, str layout_q='BSND', "
        "str layout_kv='PA_ND', bool return_softmax_lse=False) -> (Tensor, Tensor)",
    "custom.npu_sparse_attn_sharedkv_metadata":
        "npu_sparse_attn_sharedkv_metadata(int num_heads_q, int num_heads_kv, int head_dim, *, "
        "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, Tensor? cu_seqlens_cmp_kv=None, "
        "Tensor? seqused_q=None, Tensor? seqused_kv=None, int batch_size=0, int max_seqlen_q=0, "
        "int max_seqlen_kv=0, int ori_topk=0, int cmp_topk=0, int cmp_ratio=-1, int ori_mask_mode=4, "
        "int cmp_mask_mode=3, int ori_win_left=127, int ori_win_right=0, str layout_q='BSND', "
        "str layout_kv='PA_ND', bool has_ori_kv=True, bool has_cmp_kv=True, str device='npu:0') -> Tensor",
    "custom.npu_moe_gating_top_k":
        "npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None, "
        "Tensor? tid2eid=None, int k_group=1, int group_count=1, float routed_scaling_factor=1., "
        "float eps=9.9999999999999995e-21, int group_select_mode=0, int renorm=0, int norm_type=0, "
        "bool out_flag=False) -> (Tensor, Tensor, Tensor)",
    "custom.kv_compress_epilog":
        "kv_compress_epilog(Tensor(a!) kv_compress_cache, Tensor x, Tensor slot_mapping, *, "
        "int quant_group_size=64, int quant_mode=2, bool round_scale_flag=True) -> ()",
    "custom.indexer_compress_epilog":
        "indexer_compress_epilog(Tensor(a!) indexer_compress_cache, Tensor(b!) indexer_compress_scale, "
        "Tensor x, Tensor slot_mapping, *, int quant_mode=1, bool round_scale=True) -> ()",
    "custom.scatter_nd_update_asc": "scatter_nd_update_asc(Tensor(a!) var, Tensor indices, Tensor update) -> ()",
    "custom.npu_quant_lightning_indexer":
        "npu_quant_lightning_indexer(Tensor query, Tensor key, Tensor weights, Tensor query_dequant_scale, "
        "Tensor key_dequant_scale, int query_quant_mode, int key_quant_mode, *, "
        "Tensor? actual_seq_lengths_query=None, Tensor? actual_seq_lengths_key=None, Tensor? block_table=None, "
        "Tensor? metadata=None, str layout_query='BSND', str layout_key='PA_BSND', int sparse_count=2048, "
        "int sparse_mode=3, int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, "
        "int cmp_ratio=1, bool return_value=False) -> (Tensor, Tensor)",
    "custom.npu_quant_lightning_indexer_metadata":
        "npu_quant_lightning_indexer_metadata(int num_heads_q, int num_heads_k, int head_dim, "
        "int query_quant_mode, int key_quant_mode, *, Tensor? actual_seq_lengths_query=None, "
        "Tensor? actual_seq_lengths_key=None, int batch_size=0, int max_seqlen_q=0, int max_seqlen_k=0, "
        "str layout_query='BSND', str layout_key='BSND', int sparse_count=2048, int sparse_mode=3, "
        "int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, int cmp_ratio=1, "
        "str device='npu:0') -> Tensor",
}


class StubCall(NamedTuple):
    """One kernel call: the API ("torch_npu.<name>" / "custom.<name>") and its tensor arguments."""

    api: str
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass
class StubRuntime:
    """What one ``install()`` saw: kernel calls in order, and ``(op, reason)`` per fallback call."""

    calls: list[StubCall] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)

    def note_fallback(self, op: str, reason: str) -> None:
        """A ``runtime.FALLBACK_OBSERVERS`` entry: record one call of ``op`` that fell back."""
        self.fallbacks.append((op, reason))

    def kernel_counts(self) -> Counter:
        """Calls per API."""
        return Counter(c.api for c in self.calls)

    def fallback_counts(self) -> Counter:
        """Calls per ``(op, reason)`` that ran the reference op."""
        return Counter(self.fallbacks)


_STATE: dict = {}                       # "runtime" (the StubRuntime while installed), "saved" (to restore)
_LIBS: list[torch.library.Library] = []  # the "custom" fragment, kept alive for the process's life


class StubKernel:
    """One API: binds a call against its schema (``TypeError`` on unknown, duplicate or missing
    arguments, as torch_npu's bindings raise), records it on the installed ``StubRuntime`` if any,
    and runs ``bench.npu_stub_kernels.<name>`` with every argument by name (defaults filled in)."""

    def __init__(self, api: str, schema: str, impl: Callable):
        self.api, self.impl = api, impl
        self.schema = torch._C.parse_schema(schema)          # the same parser torch.library uses

    def bind(self, args: tuple, kwargs: dict) -> dict:
        """``{name: value}`` for every schema argument."""
        params = self.schema.arguments
        positional = [a for a in params if not a.kwarg_only]
        if len(args) > len(positional):
            raise TypeError(f"{self.api}: {len(args)} positional arguments, schema takes {len(positional)}")
        out = {a.name: v for a, v in zip(positional, args)}
        names = {a.name for a in params}
        for k, v in kwargs.items():
            if k not in names or k in out:
                raise TypeError(f"{self.api}: {'unknown' if k not in names else 'duplicate'} argument {k!r}")
            out[k] = v
        for a in params:
            if a.name not in out:
                if not a.has_default_value():
                    raise TypeError(f"{self.api}: missing argument {a.name!r}")
                out[a.name] = a.default_value
        return out

    def __call__(self, *args, **kwargs):
        bound = self.bind(args, kwargs)
        rt = _STATE.get("runtime")
        if rt is not None:
            rt.calls.append(StubCall(self.api, tensor_args(bound)))
        return self.impl(**bound)


def tensor_args(bound: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{name: (shape, dtype)}`` of the tensors among ``bound`` (a list's items as ``name[i]``)."""
    out = {}
    for name, v in bound.items():
        items = [(name, v)] if not isinstance(v, (list, tuple)) else [(f"{name}[{i}]", t) for i, t in enumerate(v)]
        out.update((n, (tuple(t.shape), t.dtype)) for n, t in items if isinstance(t, torch.Tensor))
    return out


def kernels(prefix: str) -> types.SimpleNamespace:
    """The stub kernels of ``prefix`` ("torch_npu" or "custom") as attributes, without installing
    anything (calls record only while a runtime is installed). Tests use it as a twin namespace."""
    return types.SimpleNamespace(**{api.split(".", 1)[1]: StubKernel(api, s, getattr(K, api.split(".", 1)[1]))
                                    for api, s in SCHEMAS.items() if api.startswith(prefix + ".")})


# the kernels whose contracts check values (cu_seqlens prefix sums): their outputs' shapes
_FAKE_SHAPES: dict[str, Callable] = {
    "npu_sparse_attn_sharedkv": lambda a: (torch.empty_like(a["q"]), torch.empty(0)),
    "npu_quant_lightning_indexer": lambda a: (
        torch.empty(a["query"].shape[0], 1, a["sparse_count"], dtype=torch.int32), torch.empty(0)),
}


def _fake(name: str, stub: "StubKernel") -> Callable:
    """A tracer's impl of a stub kernel: the kernel itself on real zeros of the traced tensors'
    shapes and dtypes (its contract checks run; values are not the point), the outputs handed back
    as fresh traced tensors of the same shapes and dtypes; in-place kernels return nothing. The
    kernels whose checks read values (``_FAKE_SHAPES``) give their documented output shapes."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._pytree import tree_map

    def impl(*args, **kwargs):
        if name in _FAKE_SHAPES:
            return _FAKE_SHAPES[name](stub.bind(args, kwargs))

        def real(t):
            return torch.zeros(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) else t
        with unset_fake_temporarily():
            out = stub.impl(**stub.bind(tree_map(real, args), tree_map(real, kwargs)))
        return tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) else t, out)
    return impl


def _registered(name: str) -> bool:
    try:                                # the namespace lookup raises when the op is not registered
        getattr(torch.ops.custom, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _custom_ops_module() -> types.ModuleType:
    """The stub ``custom_ops``: building it registers the ``custom.*`` stubs (once per process).

    Raises:
        RuntimeError: an API is already registered by something else (a real custom_ops).
    """
    if not _LIBS:
        stubs = vars(kernels("custom"))
        taken = [n for n in stubs if _registered(n)]
        if taken:
            raise RuntimeError(f"npu_stub: torch.ops.custom.{taken[0]} is already registered (a real custom_ops?); "
                               "run the stub in a clean process")
        lib = torch.library.Library("custom", "FRAGMENT")     # FRAGMENT: other "custom" ops may exist
        for name, stub in stubs.items():
            lib.define(SCHEMAS[f"custom.{name}"])
            lib.impl(name, stub, "CompositeExplicitAutograd")
            torch.library.register_fake(f"custom::{name}", _fake(name, stub), lib=lib)
        _LIBS.append(lib)
    mod = types.ModuleType("custom_ops", "bench.npu_stub: cann-recipes-infer custom_ops, stub (torch.ops.custom)")
    mod.__npu_stub__ = True
    return mod


def install() -> StubRuntime:
    """Install the stub (see the module docstring) and return the ``StubRuntime`` that records.

    Raises:
        RuntimeError: already installed; an API of ``engine.ops.npu.KERNEL_APIS`` has no stub; or a
            real ``torch.ops.custom`` op of the same name is registered.
    """
    if _STATE:
        raise RuntimeError("npu_stub: already installed (call uninstall() first)")
    missing = sorted({a for apis in KERNEL_APIS.values() for a in apis} - set(SCHEMAS))
    if missing:
        raise RuntimeError(f"npu_stub: no stub for {', '.join(missing)}")
    custom = _custom_ops_module()
    npu = types.ModuleType("torch_npu", "bench.npu_stub: torch_npu, stub (the kernels engine.ops.npu calls)")
    npu.__npu_stub__ = True
    for name, stub in vars(kernels("torch_npu")).items():
        setattr(npu, name, stub)
    rt = StubRuntime()
    _STATE["saved"] = ({m: sys.modules.get(m) for m in ("torch_npu", "custom_ops")}, runtime.NPU_DEVICE_TYPES)
    sys.modules["torch_npu"], sys.modules["custom_ops"] = npu, custom
    runtime.NPU_DEVICE_TYPES = tuple(dict.fromkeys(runtime.NPU_DEVICE_TYPES + ("cpu",)))
    runtime.FALLBACK_OBSERVERS.append(rt.note_fallback)
    _STATE["runtime"] = rt
    return rt


def uninstall() -> None:
    """Undo ``install()``: ``sys.modules``, ``NPU_DEVICE_TYPES``, ``TORCH_NPU`` and the fallback
    observer as they were. The ``torch.library`` registrations and ``api_available``'s cache stay (module
    docstring). A no-op when not installed."""
    if not _STATE:
        return
    rt = _STATE.pop("runtime")
    modules, device_types = _STATE.pop("saved")
    for name, mod in modules.items():
        if mod is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod
    runtime.NPU_DEVICE_TYPES = device_types
    runtime.TORCH_NPU = None                              # npu_ops cached the stub module there
    if rt.note_fallback in runtime.FALLBACK_OBSERVERS:
        runtime.FALLBACK_OBSERVERS.remove(rt.note_fallback)
