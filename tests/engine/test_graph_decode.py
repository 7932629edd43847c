"""Graph-mode decode (issue 6): the fixed-shape step equals the eager path, compiled or not;
moe_chunk_max_len and multi-streams change no output; buckets and wiring."""
from __future__ import annotations

import random

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list as cache_entries

from engine.build import build_engine, check_platform_version, exec_config
from engine.checkpoint import fp8_mxfp4
from engine.checkpoint.loader import load_model
from engine.config import ConfigError
from engine.platform import soc_platform
from engine.core.llm_engine import LLMEngine
from engine.platform import detect
from engine.run_config import RunConfig
from engine.core.graph_runner import DecodeRunner, ExecConfig, batch_buckets, buckets, context_buckets
from engine.core.sampling_params import SamplingParams
from engine.core.static_decode import StaticDecoder, layer_kinds

from graph_cfg import assert_close_outputs, graph_run_config, graph_threads

MAX_LEN = 1024


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    """The tiny flash cut to its first 4 layers (custom_params.num_hidden_layers): SWA, SWA, CSA
    and HCA, hash- and score-routed, so every layer kind is in the step at 2/3 of the trace and
    compile time."""
    return load_model(tiny_ckpt("flash", 1), progress=False, num_layers=4)


def _engine(model, batch_size=4, runner_cfg: ExecConfig | None = None, **kw):
    return LLMEngine.build(model, **{**dict(block_size=16, batch_size=batch_size, max_prefill_tokens=256,
                                            max_model_len=MAX_LEN, num_kv_blocks=48, num_reserved_decode_tokens=0),
                                     **kw}, graph=runner_cfg)


def _uncompiled(eng: LLMEngine) -> LLMEngine:
    """The runner's static step run eagerly (the math of graph mode without the compile time)."""
    eng.runner.graph.use_eager()
    return eng


def _workload(model, n=5, seed=0):
    rng = random.Random(seed)
    V = model.args.vocab_size
    # lengths cross CSA (4) and HCA (128) window closes during decode; 1-token and 255-token
    # prompts put single-token rows at position 0 and after a 256-token chunk
    lens = [1, 126, 255, 300, 511][:n]
    prompts = [[rng.randrange(V) for _ in range(L)] for L in lens]
    params = [SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, logprobs=4) if i % 2 == 0 else
              SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7 + i, ignore_eos=True, logprobs=4)
              for i in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def eager_out(model):
    prompts, params = _workload(model)
    eng = _engine(model)
    out = eng.generate(prompts, params)
    assert eng.num_free_blocks() == eng.num_total_blocks()
    return prompts, params, out


def test_static_step_matches_eager_with_padding(model, eager_out):
    """Batch 4 over 5 requests: buckets 1, 2, 4 with padding rows; same tokens, logprobs within
    1e-4; every block free afterwards (padding rows touched only scratch state)."""
    prompts, params, ref = eager_out
    eng = _uncompiled(_engine(model, runner_cfg=ExecConfig(exe_mode="npugraph_ex")))
    eng.runner.graph.buckets = buckets(4)
    worst = assert_close_outputs(ref, eng.generate(prompts, params))
    print(f"static vs eager: max |logprob diff| {worst:.2e}")
    assert eng.num_free_blocks() == eng.num_total_blocks()


def test_static_step_multi_streams_and_limit_core_are_noops_on_cpu(model, eager_out):
    prompts, params, ref = eager_out
    cfg = ExecConfig(exe_mode="npugraph_ex", multi_streams=True, limit_core=True)
    eng = _uncompiled(_engine(model, runner_cfg=cfg))
    assert eng.runner.graph.static.side is None and not eng.runner.graph.static.limit_core
    assert_close_outputs(ref, eng.generate(prompts, params))


def test_torch_compile_on_cpu_matches_eager(tiny_ckpt):
    """Graph mode on CPU: a regional torch.compile(fullgraph) of the static step's layer, warmed up
    by build_engine before serving, on the graph decode worker's own config (tests/graph_cfg.py:
    the worker of test_pd_graph then reads this compile from the inductor cache). Two requests,
    one greedy and one sampled, inside the smallest context bucket: one bucket compiled, at most
    one graph per layer kind (3 kinds in 4 layers), and a second engine of the config compiles
    nothing (crossing buckets is the uncompiled tests' job, the compile of another shape dynamo's)."""
    ckpt = tiny_ckpt("flash", 1)
    code = StaticDecoder.layer_step.__code__
    before = len(cache_entries(code))
    with graph_threads():
        eng = build_engine(RunConfig.from_dict(graph_run_config()), ckpt, progress=False)
    grown = len(cache_entries(code)) - before
    assert 1 <= grown <= len(layer_kinds(eng.model)) == 3 < len(eng.model.layers)
    ref_eng = build_engine(RunConfig.from_dict(graph_run_config("eager")), ckpt, progress=False)
    prompts, params = _workload(ref_eng.model, n=2)
    ref = ref_eng.generate(prompts, params)
    assert eng.runner.graph.buckets == [2] and eng.runner.graph.warmup_s > 0
    # graph mode's CPU kernels (engine/ops/cpu.py): the head compiled and probed before serving,
    # no e8m0 scale left for inductor to convert by a fallback call
    head = eng.model.head.weight
    assert eng.model.ops.lm_head._ok == {(tuple(head.shape), head.dtype): True}
    assert not any(t.dtype == torch.float8_e8m0fnu for t in eng.model.parameters())
    assert max(len(p) for p in prompts) + params[0].max_new_tokens <= eng.runner.graph.contexts[0]
    with graph_threads():
        worst = assert_close_outputs(ref, eng.generate(prompts, params))
    assert list(eng.runner.graph._fns) == [(2, eng.runner.graph.contexts[0])]
    print(f"torch.compile vs eager: max |logprob diff| {worst:.2e}, compile {eng.runner.graph.warmup_s:.0f} s")
    assert eng.num_free_blocks() == eng.num_total_blocks()
    # the layer graphs name no engine object: another engine runs them as they are
    with graph_threads():
        again = build_engine(RunConfig.from_dict(graph_run_config()), ckpt, progress=False)
        assert_close_outputs(ref, again.generate(prompts, params))
    assert len(cache_entries(code)) - before == grown


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_moe_chunk_max_len_changes_nothing(model, chunk):
    """A 300-token prefill with the routed experts dispatched in chunks: bit-identical hidden states."""
    tokens = torch.randint(0, model.args.vocab_size, (300,), generator=torch.Generator().manual_seed(3))
    model.configure(None)
    ref = model.forward(tokens, model.new_state())
    try:
        model.configure(chunk)
        got = model.forward(tokens, model.new_state())
    finally:
        model.configure(None)
    assert torch.equal(ref, got)


def test_context_buckets_size_the_entry_tables(model):
    """The step's tables hold the blocks of its context bucket: 256, 512, 1024 tokens here (c4
    entries = tokens / 4 in blocks of 16; c128 entries = tokens / 128), so a short request costs
    O(its context), not O(max_model_len)."""
    assert context_buckets(1024) == [256, 512, 1024] and context_buckets(300) == [256, 300]
    assert context_buckets(100) == [100]
    eng = _engine(model, runner_cfg=ExecConfig(exe_mode="npugraph_ex"))
    r = eng.runner.graph
    assert r.contexts == [256, 512, 1024]
    assert [r.context_bucket(n) for n in (1, 256, 257, 1024)] == [256, 256, 512, 1024]
    with pytest.raises(ValueError, match="exceed max_model_len 1024"):
        r.context_bucket(1025)
    for C, c4, c128 in ((256, 4, 1), (512, 8, 1), (1024, 16, 1)):
        t = r.static.tables([], 2, C)
        assert t["c4"].shape == (2, c4) and t["c128"].shape == (2, c128) and t["win"].shape[1] == r.static.widths["win"]
    assert r.static.tables([], 2)["c4"].shape == (2, 16)            # no bucket: max_model_len


def test_buckets_and_bucket_choice(model):
    assert buckets(1) == [1] and buckets(8) == [1, 2, 4, 8] and buckets(12) == [1, 2, 4, 8, 12]
    eng = _engine(model, batch_size=4, runner_cfg=ExecConfig(exe_mode="ge_graph"))
    assert eng.runner.graph.buckets == [4]            # CPU: one compile
    assert eng.runner.graph.bucket(3) == 4
    with pytest.raises(ValueError, match="exceed the largest bucket 4"):
        eng.runner.graph.bucket(5)
    # model_config.graph_batch_sizes: listed sizes below the rank's batch, then the batch
    assert batch_buckets(8, "cpu") == [8] and batch_buckets(8, "cuda") == [1, 2, 4, 8]
    assert batch_buckets(8, "cpu", (1,)) == [1, 8] and batch_buckets(8, "npu", (1, 4, 16)) == [1, 4, 8]
    eng = _engine(model, batch_size=4, runner_cfg=ExecConfig(exe_mode="ge_graph", batch_sizes=(1, 2)))
    assert eng.runner.graph.buckets == [1, 2, 4] and eng.runner.graph.bucket(1) == 1 and eng.runner.graph.bucket(3) == 4


def test_the_fp4_table_is_on_the_device_before_any_trace(model):
    """A copy made while dynamo traces leaves a guard that fails once it exists: the step would
    compile again at its first request (fp8_mxfp4.byte_lut)."""
    fp8_mxfp4._BYTE_LUTS.clear()
    _engine(model, runner_cfg=ExecConfig(exe_mode="ge_graph"))
    assert {(torch.device("cpu"), torch.float32), (torch.device("cpu"), torch.bfloat16)} <= set(fp8_mxfp4._BYTE_LUTS)


def _cfg(tiny, exe_mode="eager", **custom):
    return RunConfig.from_dict({
        "model_config": {"model_path": str(tiny), "dtype": "float32", "exe_mode": exe_mode,
                         "custom_params": {"moe_chunk_max_len": 64, **custom}},
        "scheduler_config": {"batch_size": 2, "block_size": 16, "max_model_len": 512, "cpu_memory_gb": 0.5}})


def test_build_engine_wires_the_run_config(tiny_ckpt):
    cfg = _cfg(tiny_ckpt("flash", 1), "npugraph_ex", enable_multi_streams=True)
    ex = exec_config(cfg)
    assert ex.graph and ex.multi_streams and ex.exe_mode == "npugraph_ex" and ex.batch_sizes is None
    raw = cfg.to_dict()
    raw["model_config"]["graph_batch_sizes"] = [1]
    assert exec_config(RunConfig.from_dict(raw)).batch_sizes == (1,)
    eng = build_engine(cfg, progress=False, graph=False)         # a prefill worker: eager, no compile
    assert eng.runner.graph is None
    assert all(layer.ffn.chunk == 64 and layer.ffn.side is None for layer in eng.model.layers)
    eager = build_engine(_cfg(tiny_ckpt("flash", 1)), progress=False)
    assert eager.runner.graph is None


@pytest.mark.parametrize("length", [3, 4, 127, 128, 515])
def test_pd_split_with_graph_decode_gives_the_same_tokens(model, length):
    """State exported by an eager prefill engine, decoded by the static step: the eager tokens."""
    prompt = torch.randint(2, model.args.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    params = SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    ref = _engine(model).generate([prompt], params)[0].output_ids
    p_eng, d_eng = _engine(model), _uncompiled(_engine(model, runner_cfg=ExecConfig(exe_mode="npugraph_ex")))
    p_eng.add_request("r", prompt, SamplingParams(**{**params.__dict__, "max_new_tokens": 1}), hold_state=True)
    while p_eng.has_unfinished():
        p_eng.step()
    seq, tensors = p_eng.pd.export_state("r")
    d_eng.pd.add_prefilled("r", prompt, seq.output_ids[0], params, tensors)
    out = [seq.output_ids[0]]
    while d_eng.has_unfinished():
        out += [t for o in d_eng.step() for t in o.new_token_ids]
    assert out == ref
    assert d_eng.num_free_blocks() == d_eng.num_total_blocks()


def test_ascend_generation_checks():
    assert [soc_platform(n) for n in ("Ascend910_9392", "Ascend910B3", "Ascend950PR", "Ascend310P")] == \
        ["A3", "A2", "950", None]
    limit = {"enable_multi_streams": True, "enable_limit_core": True}
    cfg = RunConfig.from_dict({"model_config": {"custom_params": limit}})
    check_platform_version(cfg, "A3")
    check_platform_version(cfg, None)                   # unknown SoC: the YAML decides (A3 by default)
    with pytest.raises(ConfigError, match=r"custom_params\.enable_limit_core: A3 only, but the device is '950'"):
        check_platform_version(cfg, "950")
    a2 = RunConfig.from_dict({"model_config": {"platform_version": "A2"}})
    with pytest.raises(ConfigError, match=r"model_config\.platform_version: 'A2', but the device is 'A3'"):
        check_platform_version(a2, "A3")


@pytest.mark.parametrize("block_size,max_model_len", [(4, None), (4, 290), (2, 300)])
def test_static_step_runs_to_the_end_of_max_model_len(model, block_size, max_model_len):
    """Requests that decode into the last (open) compressor window of max_model_len, where the
    entry's block lies past the block table (found by review: the gather went out of bounds)."""
    kw = dict(block_size=block_size, batch_size=3, num_kv_blocks=18 if max_model_len is None else 160)
    eager = LLMEngine.build(model, max_prefill_tokens=64, max_model_len=max_model_len, num_reserved_decode_tokens=0, **kw)
    L = eager.limits.max_model_len
    prompts = [torch.randint(2, model.args.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (L - 45, L - 20, L - 9)]
    params = SamplingParams(max_new_tokens=L, temperature=0.7, seed=5, ignore_eos=True)
    ref = eager.generate(prompts, params)
    graph = LLMEngine.build(model, max_prefill_tokens=64, max_model_len=max_model_len, num_reserved_decode_tokens=0,
                            graph=ExecConfig(exe_mode="npugraph_ex"), **kw)
    _uncompiled(graph)
    got = graph.generate(prompts, params)
    assert [s.output_ids for s in got] == [s.output_ids for s in ref]
    assert all(len(s.prompt_ids) + len(s.output_ids) == L for s in got)
    assert graph.num_free_blocks() == graph.num_total_blocks()


def test_static_step_traces_in_one_graph_with_the_ascend_op_table(tiny_ckpt):
    """With engine.ops.npu's wrappers installed (on CPU every one falls back to the reference, and
    logs), dynamo still traces the whole step as one graph (fullgraph, as npugraph_ex compiles):
    no logger call and no host-syncing fallback inside the trace. Found by review."""
    from engine.ops import REFERENCE
    from engine.ops import npu
    m = load_model(tiny_ckpt("flash", 1), ops=REFERENCE.with_overrides(**npu.KERNELS), progress=False, num_layers=4)
    eng = LLMEngine.build(m, block_size=16, batch_size=2, max_prefill_tokens=256, max_model_len=512,
                          num_kv_blocks=48, num_reserved_decode_tokens=0)
    runner = DecodeRunner(m, eng.runner.pools, 512, 2, detect("cpu"), ExecConfig(exe_mode="npugraph_ex"))
    torch._dynamo.reset()
    traced = torch.compile(runner.static.__call__, backend="eager", fullgraph=True)
    out = traced(*runner._inputs([], 2, runner.contexts[0]))
    assert out.shape == (2, m.args.hidden_size) and torch.isfinite(out).all()


def test_grouped_experts_step_gives_the_eager_tokens(tiny_ckpt):
    """Batch bucket 4: the captured step's 4 x top-6 (row, slot) pairs outnumber the 16 experts,
    so its routed experts run grouped by expert (``engine.ops.cpu.moe_grouped``); greedy and
    seeded rows, prefilled in 96-token chunks beside the decode rows, give the eager engine's
    tokens (logprobs within the graph tests' tolerance)."""
    ckpt = tiny_ckpt("flash", 1)
    raw, ref_raw = graph_run_config(), graph_run_config("eager")
    for r in (raw, ref_raw):
        r["scheduler_config"].update(batch_size=4, max_prefill_tokens=96)
    with graph_threads():
        eng = build_engine(RunConfig.from_dict(raw), ckpt, progress=False)
    assert eng.runner.graph.buckets == [4] and 4 * eng.model.args.num_experts_per_tok >= eng.model.args.n_routed_experts
    ref_eng = build_engine(RunConfig.from_dict(ref_raw), ckpt, progress=False)
    rng = random.Random(5)
    prompts = [[rng.randrange(eng.model.args.vocab_size) for _ in range(L)] for L in (1, 60, 150, 220)]
    params = [SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True, logprobs=2) if i % 2 == 0 else
              SamplingParams(max_new_tokens=20, temperature=0.9, seed=11 + i, ignore_eos=True, logprobs=2)
              for i in range(4)]
    with graph_threads():
        assert_close_outputs(ref_eng.generate(prompts, params), eng.generate(prompts, params))
    assert eng.num_free_blocks() == eng.num_total_blocks()
