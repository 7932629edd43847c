"""The engine's scheduling through its step contract, with a fake model runner: no model, no
tensors. Each test drives ``LLMEngine`` (scheduler, block accounting, P/D store, MTP policy) and
asserts the ``StepPlan`` s it hands the runner: admission, chunking, preemption and re-queue, MTP
draft room, prefix hits, P/D reserve / commit, the prefill role's hand-off."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from engine.checkpoint.make_tiny import PRESETS
from engine.config import ModelArgs
from engine.core.block_manager import CacheConfig, CacheFullError
from engine.core.llm_engine import LLMEngine
from engine.core.request import FinishReason, RequestError
from engine.core.sampling_params import Sampled, SamplingParams
from engine.core.scheduler import SchedulerLimits
from engine.core.spec_decode import num_accepted
from engine.core.step import DraftPlan, RowResult, StepPlan, StepResult

ARGS = ModelArgs.from_dict(PRESETS["flash"])        # the tiny checkpoint's config.json: shapes only


def target(req: str, pos: int) -> int:
    """The fake model's token at position ``pos`` of request ``req`` (never EOS: ids 2 ..)."""
    return 2 + int.from_bytes(hashlib.blake2b(f"{req}:{pos}".encode(), digest_size=4).digest(), "little") % 990


class FakeRunner:
    """The runner's contract without a model: samples ``target`` for every sampling position,
    drafts ``target`` too (all accepted) except for requests named in ``wrong_drafts``, and
    records every plan, draft plan and state call."""

    dp_size, cp_first_chunk, model, device = 1, 0, None, "cpu"

    def __init__(self, config: CacheConfig, wrong_drafts: set[str] = frozenset()):
        self.args, self.cache_config, self.wrong = ARGS, config, set(wrong_drafts)
        self.plans: list[StepPlan] = []
        self.drafts: list[DraftPlan] = []
        self.loads: list[tuple] = []

    def describe(self) -> dict:
        return {"exe_mode": "fake", "graph": None}

    def execute(self, plan: StepPlan, layer_hook=None) -> StepResult:
        self.plans.append(plan)
        if layer_hook is not None:
            for layer in range(ARGS.num_hidden_layers):
                layer_hook(layer)
        out = []
        for r in plan.rows:
            if r.samples:
                first = r.end - r.num_drafts               # the position the pending token's sample fills
                got = [Sampled(target(r.req_id, first + j)) for j in range(1 + r.num_drafts)]
                drafts = r.token_ids[r.num_tokens - r.num_drafts:]
                out.append(RowResult(r.req_id, got, num_accepted([g.token_id for g in got], drafts)))
        return StepResult(out)

    def draft(self, plan: DraftPlan) -> list[list[int]]:
        self.drafts.append(plan)
        out = []
        for r in plan.rows:
            nxt = r.q0 + len(r.tokens) + 1                 # the first draft is the token after the pending one
            out.append([0 if r.req_id in self.wrong else target(r.req_id, nxt + k) for k in range(r.want)])
        return out

    def load_state(self, held, num_tokens, tensors, layers=None, ops=(), rank=None):
        self.loads.append((held.state_slot, num_tokens, sorted(tensors), layers, [op.kind for op in ops]))

    def state_tensors(self, held, num_tokens, layers=None):
        return {"layers": (held.state_slot, num_tokens, layers)}

    def mtp_state_tensors(self, held, num_tokens):
        return {}


def engine(batch_size=2, max_prefill=64, max_len=1024, c4=64, c128=8, next_n=0, prefix_slots=None, reserve=0,
           wrong=frozenset()):
    cfg = CacheConfig(16, batch_size, {"c4": c4, "c128": c128}, next_n=next_n, prefix_slots=prefix_slots)
    runner = FakeRunner(cfg, wrong)
    return LLMEngine(runner, SchedulerLimits(batch_size, max_prefill, max_len, reserve), eos_ids=(1,)), runner


def shape(plan: StepPlan) -> list[tuple]:
    """A plan's rows as (request, first position, tokens, drafts, samples)."""
    return [(r.req_id, r.start, r.num_tokens, r.num_drafts, r.samples) for r in plan.rows]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, seed=1, **kw)


def test_admission_and_chunked_prefill_within_the_token_budget():
    eng, run = engine()
    for rid, n in (("a", 100), ("b", 30), ("c", 10)):
        eng.add_request(rid, list(range(2, 2 + n)), greedy(3))
    eng.step()
    eng.step()
    eng.step()
    p1, p2, p3 = run.plans
    assert shape(p1) == [("a", 0, 64, 0, False)]                     # the budget ends the step: b waits
    assert [op.kind for op in p1.pool_ops] == ["reset"]              # a's new state slot cleared first
    assert shape(p2) == [("a", 64, 36, 0, True), ("b", 0, 28, 0, False)]   # batch_size 2: c still waits
    assert shape(p3) == [("a", 100, 1, 0, True), ("b", 28, 2, 0, True)]
    assert p3.rows[0].token_ids == [target("a", 100)]                # the sampled token runs next
    a = p3.rows[0]
    assert a.block_tables["c4"] and len(a.block_tables["win"]) == eng.cache.geometry.blocks_needed("win", 0)
    assert a.sampling[0].position == 101 and a.sampling[0].output_ids == [target("a", 100)]
    while eng.has_unfinished():
        eng.step()
    assert ("c", 0, 10, 0, True) in [row for p in run.plans for row in shape(p)]
    assert eng.num_free_blocks() == eng.num_total_blocks()
    # the last frees travel with the next plan (the runner forgets what it keeps of them then)
    ops = [op for p in run.plans for op in p.pool_ops] + eng.cache.ops
    assert sorted(op.args[0] for op in ops if op.kind == "free") == ["a", "b", "c"]


def test_preemption_requeues_the_newest_and_recomputes_it():
    """Two requests whose decodes outgrow a 3-block CSA pool: the newer is preempted (its blocks
    freed), re-queued, and readmitted from position 0 with prompt + outputs as its prefill."""
    eng, run = engine(batch_size=2, max_prefill=512, max_len=190, c4=3, c128=4)
    eng.add_request("old", list(range(2, 62)), greedy(40))            # 60 tokens: 15 c4 entries
    eng.add_request("new", list(range(2, 62)), greedy(40))
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    pre = [i for i, p in enumerate(run.plans) if p.preempted]
    assert pre and run.plans[pre[0]].preempted == ["new"]
    assert "new" not in [r.req_id for r in run.plans[pre[0]].rows]    # no admission in a preempting step
    again = next(r for p in run.plans[pre[0] + 1:] for r in p.rows if r.req_id == "new")
    assert again.start == 0 and again.num_tokens > 60                 # prompt + its outputs, recomputed
    assert again.token_ids[60:] == outs["new"][:again.num_tokens - 60]
    assert outs["old"] == [target("old", 60 + i) for i in range(40)]
    assert outs["new"] == [target("new", 60 + i) for i in range(40)]  # the same tokens as undisturbed
    assert eng.scheduler.num_preemptions >= 1 and eng.num_free_blocks() == eng.num_total_blocks()


def test_mtp_drafts_fill_the_room_and_stop_at_max_new_tokens():
    eng, run = engine(next_n=3)
    eng.add_request("m", list(range(2, 22)), greedy(6))
    while eng.has_unfinished():
        eng.step()
    rows = [r for p in run.plans for r in p.rows if r.req_id == "m"]
    # token 1 from the prefill, 4 from the verify of 3 drafts, then no room for a draft: 1 plain
    assert [(r.num_tokens, r.num_drafts) for r in rows] == [(20, 0), (4, 3), (1, 0)]
    assert rows[1].token_ids == [target("m", 20 + i) for i in range(4)]
    assert eng.spec.stats.num_drafts == 1 and eng.spec.stats.num_accepted_tokens == 3
    assert run.drafts[0].rows[0].want == 3 and run.drafts[1].settle == [("m", 4)] and run.drafts[1].rows[0].want == 0


def test_rejected_drafts_are_settled_with_the_tokens_kept():
    eng, run = engine(next_n=2, wrong={"w"})
    eng.add_request("w", list(range(2, 12)), greedy(5))
    while eng.has_unfinished():
        eng.step()
    settles = [s for d in run.drafts for s in d.settle]
    assert settles and all(kept == 1 for _, kept in settles)          # every draft rejected: the sample kept
    assert eng.spec.stats.num_accepted_tokens == 0 < eng.spec.stats.num_draft_tokens


def test_a_prefix_hit_starts_at_the_boundary_with_its_copy_in_the_plan():
    eng, run = engine(max_prefill=512, prefix_slots=2)
    shared = list(range(2, 258))                                      # 256 tokens: two 128-token chunks
    eng.add_request("first", shared + [5, 6, 7], greedy(1))
    while eng.has_unfinished():
        eng.step()
    kinds = [op.kind for p in run.plans for op in p.pool_ops]
    assert "copy" in kinds and "carry_save" in kinds                  # the boundary kept (with its carry)
    n = len(run.plans)
    eng.add_request("second", shared + [8, 9], greedy(1))
    eng.step()
    plan = run.plans[n]
    assert shape(plan) == [("second", 256, 2, 0, True)]              # only the uncached tokens run
    assert [op.kind for op in plan.pool_ops][-2:] == ["copy", "carry_bind"]
    while eng.has_unfinished():
        eng.step()
    assert eng.cache.prefix.hits == 256


def test_pd_reserve_load_commit_then_decode():
    eng, run = engine(batch_size=2)
    prompt = list(range(2, 42))
    eng.pd.reserve("d", prompt, greedy(3))
    assert "d" in eng.pd.reserved and eng.scheduler.num_reserved == 1
    slot = eng.cache.seqs["d"].state_slot
    for layer in range(ARGS.num_hidden_layers):                      # layer by layer, as the transfer lands
        with pytest.raises(RequestError, match=f"layers \\[{layer}"):
            eng.pd.commit("d", target("d", 40))                       # not before its whole state is in
        eng.pd.load_state("d", {f"layers.{layer}.win_kv": None}, [layer])
    assert run.loads[0] == (slot, 40, ["layers.0.win_kv"], [0], ["reset"])   # the new slot cleared first
    assert [load[3] for load in run.loads] == [[i] for i in range(ARGS.num_hidden_layers)]
    with pytest.raises(RequestError, match="first_token"):
        eng.pd.commit("d", True)                                      # a bool is not a token id
    eng.pd.commit("d", target("d", 40))
    outs = []
    while eng.has_unfinished():
        outs += [t for o in eng.step() for t in o.new_token_ids]
    assert shape(run.plans[0]) == [("d", 40, 1, 0, True)] and run.plans[0].rows[0].token_ids == [target("d", 40)]
    assert outs == [target("d", 41), target("d", 42)]                # token #1 came from prefill
    assert eng.num_free_blocks() == eng.num_total_blocks()


def test_pd_reserve_refuses_past_the_batch_and_unreserve_frees():
    eng, run = engine(batch_size=1)
    eng.pd.reserve("a", [2, 3, 4], greedy(2))
    with pytest.raises(CacheFullError, match="batch full"):
        eng.pd.reserve("b", [2, 3, 4], greedy(2))
    assert eng.pd.unreserve("a") and not eng.pd.unreserve("a")
    eng.step()
    assert [op.kind for op in run.plans[-1].pool_ops] == ["reset", "free"]
    assert eng.num_free_blocks() == eng.num_total_blocks()


def test_the_prefill_role_hands_off_after_token_1_with_the_finish_rule_and_layer_hook():
    eng, run = engine()
    eng.add_request("p", list(range(2, 50)), greedy(16), hold_state=True)
    calls = []
    outs = eng.step(on_layer_final=lambda layer, done: calls.append((layer, done)))
    assert run.plans[0].eager and calls == [(i, [("p", 48)]) for i in range(ARGS.num_hidden_layers)]
    (out,) = outs
    assert out.finished and out.finish_reason is None and out.new_token_ids == [target("p", 48)]
    assert "p" in eng.pd.held and eng.pd.export_state("p")[1] == {"layers": (eng.cache.seqs["p"].state_slot, 48, None)}
    assert eng.pd.release("p") and eng.num_free_blocks() == eng.num_total_blocks()
    eng.add_request("q", list(range(2, 50)), greedy(1), hold_state=True)
    (out,) = eng.step()
    assert out.finish_reason is FinishReason.LENGTH                   # the sample also ends here


def test_an_abort_from_the_layer_hook_ends_that_request_only():
    """The layer hook is the caller's code inside the step: a request it aborts gets no token
    from that step, the others go on, and nothing stays held."""
    eng, run = engine()
    for rid in ("a", "b"):
        eng.add_request(rid, list(range(2, 22)), greedy(3), hold_state=True)
    outs = eng.step(on_layer_final=lambda layer, done: layer == 0 and eng.abort("a"))
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [("b", [target("b", 20)], None),
                                                                               ("a", [], FinishReason.ABORT)]
    assert "b" in eng.pd.held and eng.pd.release("b") and not eng.has_unfinished()
    assert eng.num_free_blocks() == eng.num_total_blocks()
    eng.add_request("c", list(range(2, 22)), greedy(2))
    eng.step()
    orig = run.execute
    run.execute = lambda plan, hook=None: (eng.abort("c"), orig(plan, hook))[1]   # aborted on its last token
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in eng.step()] == [("c", [], FinishReason.ABORT)]
    assert eng.num_free_blocks() == eng.num_total_blocks()


@pytest.mark.parametrize("break_it", ["short", "swapped", "empty", "over-accepted"])
def test_a_result_that_does_not_match_the_plan_aborts_the_sampled_rows(break_it, caplog):
    """A runner's rows are checked against the plan (one per sampling request, in order, with
    samples): a mismatch aborts those requests, logged, instead of giving one the other's tokens."""
    eng, run = engine()
    eng.add_request("a", list(range(2, 22)), greedy(4))
    eng.add_request("b", list(range(2, 30)), greedy(4))
    eng.step()
    orig = run.execute

    def broken(plan, hook=None):
        rows = orig(plan, hook).rows
        if break_it == "short":
            rows = rows[:-1]
        elif break_it == "swapped":
            rows = rows[::-1]
        elif break_it == "empty":
            rows = [RowResult(rows[0].req_id, []), *rows[1:]]
        else:
            rows = [RowResult(rows[0].req_id, rows[0].sampled, accepted=1), *rows[1:]]
        return StepResult(rows)

    run.execute = broken
    outs = eng.step()
    assert sorted((o.request_id, o.new_token_ids, o.finish_reason) for o in outs) == [
        ("a", [], FinishReason.ABORT), ("b", [], FinishReason.ABORT)]
    assert "model runner:" in caplog.text and not eng.has_unfinished()
    assert eng.num_free_blocks() == eng.num_total_blocks()


def test_the_step_contract_and_the_scheduling_import_no_torch():
    code = ("import sys; import engine.core.llm_engine, engine.core.step, engine.core.pd, engine.core.spec_decode; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]")
    subprocess.run([sys.executable, "-c", code], check=True)
