"""``bench.npu_stub``: with the stub installed, ``ops_for("npu")`` puts every mapped op on its NPU
wrapper, each wrapper's in-contract call (bf16, the real Flash widths where a contract fixes them)
reaches the stub kernels it names in ``KERNEL_APIS`` without falling back and returns the reference
op's shapes and dtypes (and its values where the stub computes them), an fp32 call still falls
back, and ``uninstall()`` restores the process.

The installed part runs in a child process (this file run as a script prints a JSON report):
registering ``torch.ops.custom`` here would change other tests' ``api_available`` answers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
T = 5
# the stub APIs each case must reach (sorted, without repeats)
EXPECTED = {
    "rms_norm": ["torch_npu.npu_rms_norm"],
    "rope": ["custom.inplace_partial_rotary_mul"],
    "grouped_linear": ["torch_npu.npu_transpose_batchmatmul"],
    "hc_pre": ["custom.npu_hc_pre"],
    "hc_post": ["custom.npu_hc_post"],
    "sparse_attn": ["custom.npu_sparse_attn_sharedkv", "custom.npu_sparse_attn_sharedkv_metadata"],
    "sparse_attn_hca": ["custom.npu_sparse_attn_sharedkv", "custom.npu_sparse_attn_sharedkv_metadata"],
    "sparse_attn_window": ["custom.npu_sparse_attn_sharedkv", "custom.npu_sparse_attn_sharedkv_metadata"],
    "gating_topk": ["custom.npu_moe_gating_top_k"],
    "gating_topk_hash": ["custom.npu_moe_gating_top_k"],
    "swiglu_clamp": ["torch_npu.npu_clipped_swiglu"],
    "moe_experts": ["torch_npu.npu_clipped_swiglu", "torch_npu.npu_grouped_matmul",
                    "torch_npu.npu_moe_finalize_routing", "torch_npu.npu_moe_init_routing_v2"],
    "moe_experts_w8a8": ["torch_npu.npu_clipped_swiglu", "torch_npu.npu_dynamic_quant",
                         "torch_npu.npu_grouped_matmul", "torch_npu.npu_moe_finalize_routing",
                         "torch_npu.npu_moe_init_routing_v2"],
    "quant_linear": ["torch_npu.npu_dynamic_quant", "torch_npu.npu_quant_matmul"],
    "quant_linear_wide": ["torch_npu.npu_dynamic_quant", "torch_npu.npu_quant_matmul"],
    "grouped_linear_wide": ["torch_npu.npu_transpose_batchmatmul"],
    "grouped_linear_15x8192": ["torch_npu.npu_transpose_batchmatmul"],
    "cache_write_kv_fp8": ["custom.kv_compress_epilog"],
    "cache_write_indexer_fp8": ["custom.indexer_compress_epilog"],
    "cache_write_indexer_int8": ["custom.scatter_nd_update_asc", "torch_npu.npu_dynamic_quant"],
    "cache_write_kv_none": ["custom.scatter_nd_update_asc"],
    "cache_indexer_topk": ["custom.npu_quant_lightning_indexer", "custom.npu_quant_lightning_indexer_metadata",
                           "torch_npu.npu_dynamic_quant"],
    "decode_sparse_attn": ["custom.npu_sparse_attn_sharedkv", "custom.npu_sparse_attn_sharedkv_metadata"],
    "decode_sparse_attn_hca": ["custom.npu_sparse_attn_sharedkv", "custom.npu_sparse_attn_sharedkv_metadata"],
    "decode_sparse_attn_window": ["custom.npu_sparse_attn_sharedkv", "custom.npu_sparse_attn_sharedkv_metadata"],
    "decode_sparse_attn_no_entry_yet": ["custom.npu_sparse_attn_sharedkv", "custom.npu_sparse_attn_sharedkv_metadata"],
    "decode_sparse_attn_captured": ["custom.npu_sparse_attn_sharedkv", "custom.npu_sparse_attn_sharedkv_metadata"],
    "decode_sparse_attn_128_heads": ["custom.npu_sparse_attn_sharedkv", "custom.npu_sparse_attn_sharedkv_metadata"],
    "decode_indexer_topk": ["custom.npu_quant_lightning_indexer", "custom.npu_quant_lightning_indexer_metadata",
                            "torch_npu.npu_dynamic_quant"],
}
PLACEHOLDER = {"sparse_attn", "sparse_attn_hca", "sparse_attn_window", "decode_sparse_attn", "decode_sparse_attn_hca",
               "decode_sparse_attn_window", "decode_sparse_attn_no_entry_yet", "decode_sparse_attn_captured",
               "decode_sparse_attn_128_heads"}                           # zeros: shape / dtype only
DECODE_POS = [600, 601, 130]          # three decode rows (B = 3), blocks of 16, a ring of 256 slots


def _cases() -> dict[str, tuple[str, tuple]]:
    """Case name -> (op, in-contract bf16 arguments)."""
    from engine.ops import reference as R
    from engine.ops.cache_codec import CacheCodec, CacheRows
    from engine.ops.packed import Packed
    g = torch.Generator().manual_seed(0)
    bf, f32 = torch.bfloat16, torch.float32

    def rnd(*shape, dtype=bf, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    def int8(*shape):
        return Packed(torch.randint(-127, 128, shape, generator=g, dtype=torch.int8),
                      rnd(*shape[:-1], 1, dtype=f32).abs() * 0.01, "int8")

    def pool(kind, dim, indexer, rows=12):
        return CacheRows.zeros(CacheCodec(kind, dim, bf, rope_dim=0 if indexer else 64, indexer=indexer), rows, "cpu")

    ang = rnd(T, 32, dtype=f32)
    gw, gid = R.gating_topk(rnd(T, 8, dtype=f32), rnd(8, dtype=f32), None, 2, 1.5)
    pos = torch.arange(600, 602)                                       # CSA: 150 closed entries, top-k 512
    topk = torch.full((2, 512), -1)
    topk[:, :150] = torch.arange(150)
    keys = pool("int8", 128, True, rows=3 * 16 + 1)                   # 3 blocks of 16 + the trash row
    ids = torch.arange(71 // 4)                                        # entries 0..16 in blocks 2, 0
    keys.write(torch.tensor([2, 0])[ids // 16] * 16 + ids % 16, rnd(17, 128))
    dec = _decode_cases(rnd, pool)
    return {
        **dec,
        "rms_norm": ("rms_norm", (rnd(T, 4096), rnd(4096, dtype=f32), 1e-6)),
        "rope": ("rope", (rnd(T, 64, 512), ang.cos(), ang.sin())),
        "grouped_linear": ("grouped_linear", (rnd(T, 2, 64), rnd(2 * 32, 64, s=0.1))),
        "hc_pre": ("hc_pre", (rnd(T, 4, 4096), rnd(24, 16384, dtype=f32, s=0.01), rnd(3, dtype=f32),
                              rnd(24, dtype=f32), 1e-6, 1e-6, 20)),
        "hc_post": ("hc_post", (rnd(T, 4096), rnd(T, 4, 4096), rnd(T, 4, dtype=f32).sigmoid(),
                                rnd(T, 4, 4, dtype=f32).softmax(-1))),
        "sparse_attn": ("sparse_attn", (rnd(2, 64, 512), pos, rnd(129, 512), 473, 128, rnd(150, 512), 4, topk,
                                        rnd(64, dtype=f32), 0.04)),
        "sparse_attn_hca": ("sparse_attn", (rnd(2, 64, 512), pos, rnd(129, 512), 473, 128, rnd(5, 512), 128, None,
                                            rnd(64, dtype=f32), 0.04)),
        "sparse_attn_window": ("sparse_attn", (rnd(2, 64, 512), pos, rnd(129, 512), 473, 128, None, 1, None,
                                               rnd(64, dtype=f32), 0.04)),
        "gating_topk": ("gating_topk", (rnd(T, 256, dtype=f32), rnd(256, dtype=f32, s=0.1), None, 6, 2.5)),
        "gating_topk_hash": ("gating_topk", (rnd(T, 256, dtype=f32), None,
                                             torch.randint(0, 256, (T, 6), generator=g), 6, 2.5)),
        "swiglu_clamp": ("swiglu_clamp", (rnd(T, 2048, s=4), rnd(T, 2048, s=4), 10.0)),
        "moe_experts": ("moe_experts", (rnd(T, 64), gid, gw, rnd(8, 32, 64, s=0.1), rnd(8, 32, 64, s=0.1),
                                        rnd(8, 64, 32, s=0.1), 10.0)),
        "moe_experts_w8a8": ("moe_experts", (rnd(T, 64), gid, gw, int8(8, 32, 64), int8(8, 32, 64), int8(8, 64, 32),
                                             10.0, "int8-token")),
        "quant_linear": ("quant_linear", (rnd(T, 64), int8(32, 64), "int8-token")),
        # Pro's wq_b: 65,536 output rows, past the kernel's 65,535 (two slices of n)
        "quant_linear_wide": ("quant_linear", (rnd(T, 64), int8(65536, 64), "int8-token")),
        # Pro's wo_a: 16 groups of K = 4096, K * G = 65,536 (two calls of 8 groups)
        "grouped_linear_wide": ("grouped_linear", (rnd(T, 16, 4096, s=0.1), rnd(16 * 16, 4096, s=0.02))),
        # 7 groups of K = 8192 fit a call: 15 groups go in 3 calls of 5 (2 of 8 would break the cap)
        "grouped_linear_15x8192": ("grouped_linear", (rnd(T, 15, 8192, s=0.1), rnd(15 * 16, 8192, s=0.02))),
        "cache_write_kv_fp8": ("cache_write", (pool("fp8", 512, False), torch.tensor([7, 0, 3]), rnd(3, 512))),
        "cache_write_indexer_fp8": ("cache_write", (pool("fp8", 128, True), torch.tensor([7, 0, 3]), rnd(3, 128))),
        "cache_write_indexer_int8": ("cache_write", (pool("int8", 128, True), torch.tensor([7, 0, 3]),
                                                     rnd(3, 128))),
        # the bf16 window ring / entries: rows as they are
        "cache_write_kv_none": ("cache_write", (pool("none", 512, False), torch.tensor([7, 0, 3]), rnd(3, 512))),
        # weights exact in fp16 and scale 1: the kernel's fp16 weights score as the reference does
        "cache_indexer_topk": ("cache_indexer_topk", (rnd(T, 64, 128), torch.randint(-8, 9, (T, 64), generator=g) / 64,
                                                      keys, torch.tensor([2, 0]), 16, torch.arange(66, 71), 4, 512,
                                                      1.0)),
    }


def _decode_cases(rnd, pool) -> dict[str, tuple[str, tuple]]:
    """B = 3 decode rows over paged pools: each row its own ring blocks, entry blocks and key blocks."""
    from engine.ops.cache_codec import CacheCodec, CacheRows
    g = torch.Generator().manual_seed(1)
    bs, ring, B = 16, 256, len(DECODE_POS)
    pos = torch.tensor(DECODE_POS)
    win = CacheRows.zeros(CacheCodec("none", 512, torch.bfloat16), B * ring + 1, "cpu")
    win.write(torch.arange(B * ring), rnd(B * ring, 512))
    win_table = torch.arange(B * ring // bs).view(B, ring // bs)
    csa = CacheRows.zeros(CacheCodec("none", 512, torch.bfloat16), B * 10 * bs + 1, "cpu")
    csa.write(torch.arange(B * 10 * bs), rnd(B * 10 * bs, 512))
    csa_table = torch.randperm(B * 10, generator=g).view(B, 10)
    n = [(p + 1) // 4 for p in DECODE_POS]
    topk = torch.full((B, 512), -1)
    for b in range(B):
        topk[b, :n[b]] = torch.arange(n[b])
    hca = CacheRows.zeros(CacheCodec("none", 512, torch.bfloat16), B * bs + 1, "cpu")
    hca.write(torch.arange(B * bs), rnd(B * bs, 512))
    keys = pool("int8", 128, True, rows=B * 3 * bs + 1)
    keys.write(torch.arange(B * 3 * bs), rnd(B * 3 * bs, 128))
    ipos = torch.tensor([66, 70, 40])
    q, sinks = rnd(B, 64, 512), rnd(64, dtype=torch.float32)
    return {
        "decode_sparse_attn": ("decode_sparse_attn", (q, pos, DECODE_POS, win, win_table, ring, 128, csa, csa_table, 4,
                                                      topk, sinks, 0.04, bs)),
        "decode_sparse_attn_hca": ("decode_sparse_attn", (q, pos, DECODE_POS, win, win_table, ring, 128, hca,
                                                          torch.arange(B).view(B, 1), 128, None, sinks, 0.04, bs)),
        "decode_sparse_attn_window": ("decode_sparse_attn", (q, pos, DECODE_POS, win, win_table, ring, 128, None, None,
                                                             1, None, sinks, 0.04, bs)),
        # Pro's 128 heads on an HCA layer: two calls of 64 heads
        "decode_sparse_attn_128_heads": ("decode_sparse_attn", (rnd(B, 128, 512), pos, DECODE_POS, win, win_table, ring,
                                                                128, hca, torch.arange(B).view(B, 1), 128, None,
                                                                rnd(128, dtype=torch.float32), 0.04, bs)),
        # an HCA layer before any row closed a window: no row holds an entry block, so no table
        # (DecodeRows leaves it out); the call is window-only
        "decode_sparse_attn_no_entry_yet": ("decode_sparse_attn", (q[:2], torch.tensor([5, 40]), [5, 40], win,
                                                                   win_table[:2], ring, 128, hca, None, 128, None,
                                                                   sinks, 0.04, bs)),
        # a captured step: no host positions, the context bucket (1024) bounds the tiling
        "decode_sparse_attn_captured": ("decode_sparse_attn", (q, pos, None, win, win_table, ring, 128, csa,
                                                               csa_table, 4, topk, sinks, 0.04, bs, 1024)),
        # weights exact in fp16, scale 1: the kernel's fp16 weights score as the reference does
        "decode_indexer_topk": ("decode_indexer_topk", (rnd(B, 64, 128),
                                                        torch.randint(-8, 9, (B, 64), generator=g) / 64, keys,
                                                        torch.randperm(B * 3, generator=g).view(B, 3), bs, ipos,
                                                        ipos.tolist(), 4, 8, 1.0)),
    }


def _close(got, want) -> bool:
    """Same values: exact for ids, pools and int outputs; float outputs within 2% of their largest
    magnitude (bf16 rounding, and W8A8's int8 rounding of the hidden rows, differ per element)."""
    if isinstance(got, tuple):
        return all(_close(a, b) for a, b in zip(got, want))
    if not got.is_floating_point():
        return torch.equal(got, want)
    return bool((got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max() + 1e-3)


def _describe(out) -> list:
    outs = out if isinstance(out, tuple) else (out,)
    return [None if o is None else [list(o.shape), str(o.dtype)] for o in outs]


def child_report() -> dict:
    """Install the stub, run every case through ``ops_for("npu")`` and the reference, uninstall."""
    import copy

    import engine.ops.npu as npu
    import engine.ops.reference as R
    from bench import npu_stub
    from engine.ops import ops_for
    rt = npu_stub.install()
    table = ops_for("npu")
    rep = {"not_wrapped": [op for op in npu.KERNEL_APIS if getattr(table, op) is not npu.KERNELS[op]],
           "all_apis": sorted({a for apis in npu.KERNEL_APIS.values() for a in apis}), "cases": {}}
    for name, (op, args) in _cases().items():
        ref_args = copy.deepcopy(args)                                 # the pools are written in place
        n_calls, n_fb = len(rt.calls), len(rt.fallbacks)
        out, want = getattr(table, op)(*args), getattr(R, op)(*ref_args)
        if op == "cache_write":                                        # compare the pools' bytes
            out, want = tuple(args[0].parts), tuple(ref_args[0].parts)
        rep["cases"][name] = {"apis": sorted({c.api for c in rt.calls[n_calls:]}), "fallbacks": rt.fallbacks[n_fb:],
                              "shapes": {c.api: {k: list(v[0]) for k, v in c.tensors.items()} for c in rt.calls[n_calls:]},
                              "counts": {a: sum(c.api == a for c in rt.calls[n_calls:])
                                         for a in {c.api for c in rt.calls[n_calls:]}},
                              "got": _describe(out), "want": _describe(want),
                              "close": None if name in PLACEHOLDER else _close(out, want)}
    # what a graph step asks before it calls moe_experts (StaticDecoder._experts): None where the
    # kernels run the inputs, the fallback's reason elsewhere; reachable through the table
    why = table.moe_experts.why
    cases = _cases()
    w8 = cases["moe_experts_w8a8"][1]
    dense = cases["moe_experts"][1]
    rep["moe_why"] = {"w8a8": why(w8[0], w8[1], *w8[3:6], w8[7]), "bf16": why(dense[0], dense[1], *dense[3:6], None),
                      "fp32": why(dense[0].float(), dense[1], *dense[3:6], None),
                      "int8 weights, bf16 activations": why(w8[0], w8[1], *w8[3:6], None)}
    n_calls = len(rt.calls)
    x = torch.randn(T, 64)
    rep["fp32"] = {"same": torch.equal(table.rms_norm(x, None, 1e-6), R.rms_norm(x, None, 1e-6)),
                   "calls": len(rt.calls) - n_calls, "fallbacks": rt.fallbacks[-1:]}
    npu_stub.uninstall()
    n_fb = len(rt.fallbacks)
    table.rms_norm(x.bfloat16(), None, 1e-6)
    rep["after"] = {"modules": [m for m in ("torch_npu", "custom_ops") if m in sys.modules],
                    "device_types": list(npu.runtime.NPU_DEVICE_TYPES),
                    "observers": len(npu.runtime.FALLBACK_OBSERVERS), "recorded": len(rt.fallbacks) - n_fb,
                    "calls": len(rt.calls) - n_calls}
    try:
        ops_for("npu")
        rep["after"]["ops_for"] = "built"
    except ImportError as e:
        rep["after"]["ops_for"] = type(e).__name__
    return rep


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_every_mapped_op_gets_its_wrapper(report):
    assert report["not_wrapped"] == []


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_in_contract_call_reaches_the_stub_kernels(report, name):
    case = report["cases"][name]
    assert case["fallbacks"] == [] and case["apis"] == EXPECTED[name]
    assert case["got"] == case["want"]                                  # the reference op's shapes and dtypes
    assert case["close"] in (None, True) and (case["close"] is None) == (name in PLACEHOLDER)


def test_decode_rows_are_one_kernel_call_of_b_sequences(report):
    B, S2 = len(DECODE_POS), max(DECODE_POS) + 1
    for name in ("decode_sparse_attn", "decode_sparse_attn_hca", "decode_sparse_attn_window"):
        a = report["cases"][name]["shapes"]["custom.npu_sparse_attn_sharedkv"]
        assert a["q"] == [B, 64, 512] and a["cu_seqlens_q"] == [B + 1] and a["seqused_kv"] == [B]
        assert a["ori_kv"] == [B * 256 // 16, 16, 1, 512]              # the ring pool in place, no copy
        assert a["ori_block_table"] == [B, -(-S2 // 16)]               # O(context) logical blocks per row
    csa = report["cases"]["decode_sparse_attn"]["shapes"]["custom.npu_sparse_attn_sharedkv"]
    assert csa["cmp_sparse_indices"] == [B, 1, 512] and csa["cmp_block_table"] == [B, 10]
    for name in ("decode_sparse_attn_window", "decode_sparse_attn_no_entry_yet"):
        assert "cmp_kv" not in report["cases"][name]["shapes"]["custom.npu_sparse_attn_sharedkv"]
    pro = report["cases"]["decode_sparse_attn_128_heads"]
    assert pro["counts"] == {"custom.npu_sparse_attn_sharedkv": 2, "custom.npu_sparse_attn_sharedkv_metadata": 1}
    assert pro["shapes"]["custom.npu_sparse_attn_sharedkv"]["q"] == [B, 64, 512] and pro["got"] == [[[B, 128, 512],
                                                                                                     "torch.bfloat16"]]
    cap = report["cases"]["decode_sparse_attn_captured"]["shapes"]["custom.npu_sparse_attn_sharedkv"]
    assert cap["ori_block_table"] == [B, 1024 // 16] and cap["seqused_kv"] == [B]   # the bucket's blocks
    li = report["cases"]["decode_indexer_topk"]["shapes"]["custom.npu_quant_lightning_indexer"]
    assert li["query"] == [B, 64, 128] and li["block_table"] == [B, 3] and li["actual_seq_lengths_key"] == [B]


def test_weights_past_the_kernels_dim_caps_split_instead_of_falling_back(report):
    wide = report["cases"]["quant_linear_wide"]
    assert wide["counts"] == {"torch_npu.npu_dynamic_quant": 1, "torch_npu.npu_quant_matmul": 2}
    assert wide["shapes"]["torch_npu.npu_quant_matmul"]["x2"] == [64, 32768]
    grouped = report["cases"]["grouped_linear_wide"]
    assert grouped["counts"] == {"torch_npu.npu_transpose_batchmatmul": 2}
    assert grouped["shapes"]["torch_npu.npu_transpose_batchmatmul"]["weight"] == [8, 4096, 16]
    odd = report["cases"]["grouped_linear_15x8192"]
    assert odd["counts"] == {"torch_npu.npu_transpose_batchmatmul": 3} and odd["fallbacks"] == []
    assert wide["close"] is True and grouped["close"] is True and odd["close"] is True


def test_the_cases_reach_every_api(report):
    assert sorted({a for c in report["cases"].values() for a in c["apis"]}) == report["all_apis"]


def test_a_graph_step_can_ask_moe_experts_whether_it_runs_the_inputs(report):
    why = report["moe_why"]
    assert why["w8a8"] is None and why["bf16"] is None
    assert why["fp32"] == "x dtype float32, kernel path takes bfloat16/float16"
    assert why["int8 weights, bf16 activations"] == "int8 experts with None activations (only W8A8 int8 is mapped)"


def test_fp32_still_falls_back(report):
    fp32 = report["fp32"]
    assert fp32["same"] and fp32["calls"] == 0
    [(op, reason)] = fp32["fallbacks"]
    assert op == "rms_norm" and "dtype float32" in reason


def test_uninstall_restores_the_process(report):
    assert report["after"] == {"modules": [], "device_types": ["npu"], "observers": 0, "recorded": 0, "calls": 0,
                               "ops_for": "NpuUnavailableError"}


# ---- in this process: nothing installed ------------------------------------------------------------
def test_import_installs_nothing_and_kernels_check_their_contract():
    from bench import npu_stub
    from bench.npu_stub_kernels import ContractError
    assert "torch_npu" not in sys.modules and "custom_ops" not in sys.modules
    npu = npu_stub.kernels("torch_npu")
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    y, rstd = npu.npu_rms_norm(x, torch.ones(16, dtype=torch.bfloat16), epsilon=1e-6)
    assert y.dtype == torch.bfloat16 and rstd.shape == (2, 1)
    with pytest.raises(TypeError, match="unknown argument 'eps'"):
        npu.npu_rms_norm(x, torch.ones(16), eps=1e-6)
    with pytest.raises(TypeError, match="missing argument 'gamma'"):
        npu.npu_rms_norm(x)
    with pytest.raises(ContractError, match="npu_dynamic_quant: input fp16 / bf16"):
        npu.npu_dynamic_quant(x.float())
    with pytest.raises(NotImplementedError, match="rotary_mode 'half'"):
        npu_stub.kernels("custom").inplace_partial_rotary_mul(x.view(1, 2, 1, 16), x[:, :8], x[:, :8],
                                                              rotary_mode="half", partial_slice=[8, 16])


if __name__ == "__main__":
    print(json.dumps(child_report()))
