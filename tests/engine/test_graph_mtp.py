"""Graph-mode decode with MTP (next_n > 0): the verify step (the pending token and up to next_n
drafts per request) runs through the fixed-shape ``StaticDecoder`` at span ``1 + next_n``, and
gives the eager MTP engine's tokens (identical) and logprobs (within the graph step's bound), with
drafts accepted, partly accepted and rejected across CSA and HCA window closes; the span step
traces as one graph."""
from __future__ import annotations

import random

import pytest
import torch

from engine.checkpoint.loader import load_model
from engine.core.graph_runner import DecodeRunner, ExecConfig
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.platform import detect
from graph_cfg import assert_close_outputs

MAX_LEN = 512


@pytest.fixture(scope="module")
def agree(tiny_ckpt):
    """The MTP layer agrees with the trunk: drafts are accepted, so rollbacks keep 1 .. 3 tokens."""
    return load_model(tiny_ckpt("flash", 1, mtp_agree=True), dtype=torch.float32, progress=False, mtp=True)


def _engine(model, next_n: int, graph: bool, batch_size: int = 4, **kw) -> LLMEngine:
    eng = LLMEngine.build(model, **{**dict(block_size=16, batch_size=batch_size, max_prefill_tokens=64,
                                           max_model_len=MAX_LEN, num_kv_blocks=60, num_reserved_decode_tokens=0,
                                           next_n=next_n), **kw},
                          graph=ExecConfig(exe_mode="npugraph_ex") if graph else None)
    if graph:
        eng.runner.graph.use_eager()  # the static step's math without the compile time
    return eng


def _run(eng: LLMEngine, prompts, params):
    out = eng.generate(prompts, params)
    assert eng.num_free_blocks() == eng.num_total_blocks()            # nothing leaks
    return out


def _prompts(n: int, seed: int, lens=(118, 9, 61, 3)):
    rng = random.Random(seed)
    return [[rng.randrange(1000, 60000) for _ in range(lens[i % len(lens)])] for i in range(n)]


@pytest.mark.parametrize("next_n", [1, 3])
def test_graph_verify_equals_the_eager_mtp_engine(agree, next_n):
    """Seeded sampling at temperature 0.1 and greedy: drafts are kept whole, in part and not at
    all; a 118-token prompt decodes across the HCA window at 128 and CSA windows every 4 tokens,
    so rejected drafts close windows the rollback must undo. Every verify span ran in the graph
    step, and tokens / logprobs are the eager engine's."""
    prompts = _prompts(4, seed=next_n)
    params = [SamplingParams(max_new_tokens=20, temperature=0.1 if i % 2 else 0.0, seed=5 + i, logprobs=2,
                             ignore_eos=True) for i in range(len(prompts))]
    want = _run(_engine(agree, next_n, graph=False), prompts, params)
    eng = _engine(agree, next_n, graph=True)
    calls = []
    run = eng.runner.graph.run
    eng.runner.graph.run = lambda rows: calls.append([len(r[0]) for r in rows]) or run(rows)
    got = _run(eng, prompts, params)
    worst = assert_close_outputs(got, want)
    st = eng.spec.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert max(max(c) for c in calls) == 1 + next_n and any(1 in c for c in calls)
    print(f"graph vs eager MTP, next_n {next_n}: max |logprob diff| {worst:.2e}, "
          f"acceptance {st.acceptance_rate:.2f}, {len(calls)} graph steps")


def test_graph_verify_with_rejected_drafts_and_preemption_equals_next_n_0(tiny_ckpt):
    """The random model (drafts almost always rejected), pools tight enough to preempt: the graph
    MTP engine's tokens are the eager next_n 0 engine's, and every block comes back."""
    model = load_model(tiny_ckpt("flash", 1), dtype=torch.float32, progress=False, mtp=True)
    prompts = _prompts(4, seed=7, lens=(60, 100, 75, 90))
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    want = _run(_engine(model, 0, graph=False, num_kv_blocks=40), prompts, params)
    eng = _engine(model, 3, graph=True, num_kv_blocks=40)
    got = _run(eng, prompts, params)
    assert_close_outputs(got, want)
    assert eng.spec.stats.num_drafts > 0


def test_the_span_step_traces_as_one_graph(agree):
    """The span-4 step (next_n 3) has no graph break: torch.compile(fullgraph=True) traces it
    whole (backend "eager": dynamo's trace without inductor's compile time)."""
    eng = _engine(agree, 3, graph=True, batch_size=2)
    r = eng.runner.graph
    traced = torch.compile(r.static.__call__, backend="eager", fullgraph=True)
    hidden, streams = traced(*r._inputs([], 2, r.contexts[0]))
    H = agree.args.hidden_size
    assert hidden.shape == (8, H) and streams.shape == (8, agree.args.hc_mult, H)
    assert torch.isfinite(hidden).all()


def test_a_span_past_the_csa_ratio_or_not_1_plus_next_n_is_refused(agree):
    eng = _engine(agree, 1, graph=False)
    with pytest.raises(ValueError, match="span must be 1 .. 4"):
        DecodeRunner(agree, eng.runner.pools, MAX_LEN, 2, detect("cpu"), ExecConfig(exe_mode="npugraph_ex"), span=5)
    # a graph step of another span cannot be handed to an MTP engine any more: its model runner
    # builds the captured step, at span 1 + next_n, and runs every verify span through it
    g = _engine(agree, 1, graph=True)
    assert g.runner.span == g.runner.graph.span == g.runner.graph.static.span == 2
    assert g.runner.decoder is g.runner.graph.static and eng.runner.decoder.span == 2


@pytest.fixture(scope="module")
def graph_mtp_pair(ckpt):
    from rank_pair import rank_pair
    yield from rank_pair(ckpt, "configs/tiny-flash-mtp.yaml", graph=True)


def test_a_follower_replays_graph_verify_steps(graph_mtp_pair, reference):
    """A multi-rank instance's graph MTP step (LeaderRunner / follower, world 1 models):
    the verify spans go to the follower as one graph step with their spec_k, each rank makes its
    own rollbacks and keeps its own streams for the draft step, so the follower's pools, MTP rings
    included, equal the leader's after every step; a step holding a prefill chunk runs eager on
    both; the tokens are the eager next_n 0 engine's."""
    from rank_pair import replay_mtp_requests
    graph = graph_mtp_pair[1].runner.graph
    spans, step = [], graph.step
    graph.step = lambda rows, B, C: spans.append([len(r[0]) for r in rows]) or step(rows, B, C)
    replay_mtp_requests(graph_mtp_pair, reference)
    assert spans and max(max(s) for s in spans) == 4                # spans of 1 + next_n 3 on the follower


def test_span_rollback_restores_the_rejected_rows_of_each_settled_span(agree):
    """SpanRollback on its own: two requests' spans write every row they touch (as the graph step
    does); "a" keeps 1 of 4 tokens (its CSA close at L + 2 rejected): its rejected rows and its
    previous window come back, its accepted row keeps the new value; "b" ends unsettled (freed):
    nothing of it is restored, and "a" is still restored when it settles after b's free (the
    runner's ``draft`` settles what its ``DraftPlan.settle`` names, and drops the rollback)."""
    from engine.config import CSA_RATIO
    from engine.core.mtp_runner import SpanRollback
    from engine.core.step import DraftPlan
    eng = _engine(agree, 3, graph=False)
    cache, pools = eng.cache, eng.runner.pools
    for sid in ("a", "b"):
        cache.allocate(sid, 140)
    eng.runner.apply_ops(cache.take_ops())
    L, span, m = 129, 4, CSA_RATIO                      # positions 129 .. 132: 131 closes a CSA window
    slots = {sid: cache.seqs[sid].state_slot for sid in ("a", "b")}
    kv, score = pools.comp_stacks["c4"][1]
    for t in (kv, score):
        t.normal_()
    before = kv.clone()
    rb = SpanRollback(pools, [(sid, slots[sid], L, span) for sid in ("a", "b")])
    rows = [(L + j) % m for j in range(span)]
    for sid in ("a", "b"):                              # the step writes its rows and the previous window
        kv[:, slots[sid], rows] = 7.0
        kv[:, slots[sid], m:2 * m] = 9.0
    eng.runner.spans = rb
    cache.free("b")                                     # ended before its settle: not settled
    eng.runner.apply_ops(cache.take_ops())
    assert eng.runner.draft(DraftPlan(settle=[("a", 1)])) == []
    assert eng.runner.spans is None and rb.kept == {"a": 1}          # b's span is never restored
    a = slots["a"]
    assert (kv[:, a, rows[0]] == 7.0).all()                                    # accepted: the step's row
    assert torch.equal(kv[:, a, rows[1:]], before[:, a, rows[1:]])             # rejected: restored
    assert torch.equal(kv[:, a, m:2 * m], before[:, a, m:2 * m])               # previous window restored
    assert (kv[:, slots["b"], rows] == 7.0).all()
