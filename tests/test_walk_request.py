"""scripts/walk_request.py: its figures from hand-made events, and one real walk on the tiny model (~20 s)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("walk_request", ROOT / "scripts" / "walk_request.py")
walk_request = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(walk_request)

# [thread, callee file, qualname, caller file, step]
EVENTS = [
    ["main", "server/workers/base.py", "Worker.loop", None, -1],
    ["main", "engine/core/llm_engine.py", "LLMEngine.step", "server/workers/base.py", 0],
    ["main", "engine/core/scheduler.py", "Scheduler.schedule", "engine/core/llm_engine.py", 0],
    ["main", "engine/core/scheduler.py", "Scheduler._pick", "engine/core/scheduler.py", 0],
    ["main", "engine/model/transformer.py", "Transformer.forward", "engine/core/llm_engine.py", 0],
    ["main", "engine/core/paged_state.py", "PagedState.write", "engine/model/transformer.py", 0],
    ["main", "engine/core/llm_engine.py", "LLMEngine.step", "server/workers/base.py", 1],
    ["main", "engine/core/scheduler.py", "Scheduler.schedule", "engine/core/llm_engine.py", 1],
    ["main", "server/workers/base.py", "Worker.on_outputs", "server/workers/base.py", -1],
]


def test_summarise_counts_hops_edges_entries_and_back_ups():
    s = walk_request.summarise(EVENTS)
    assert s["calls"] == 9
    assert s["files"] == ["server/workers/base.py", "engine/core/llm_engine.py", "engine/core/scheduler.py",
                          "engine/model/transformer.py", "engine/core/paged_state.py"]
    assert s["hops"] == 6                    # every call whose caller is another file
    assert s["edges"] == 4 and s["entries"] == 1
    assert s["back_ups"] == ["engine/model/transformer.py -> engine/core/paged_state.py"]


def test_report_names_roles_and_takes_the_middle_step():
    recs = [{"argv": ["python", "-m", "server.launch.cli", "--role", "decode"], "events": EVENTS},
            {"argv": ["python", "-m", "server.launch.cli", "--role", "local"], "events": []},
            {"argv": ["python", "-m", "server.launch.cli", "--role=decode"], "events": []}]
    res = walk_request.report(recs)
    assert sorted(res) == ["decode", "decode2", "launcher"]
    step = res["decode"]["step"]
    assert (step["index"], step["of"]) == (2, 2) and res["decode"]["step_hops"] == [4, 2]
    assert step["files"] == ["engine/core/llm_engine.py", "engine/core/scheduler.py"]
    res["request"] = {"seconds": 0.5, "chunks": 3, "max_tokens": 4}
    text = walk_request.render(res, walk_request.STEP)
    assert "decode step 2 of 2 (LLMEngine.step)" in text and "hops of each decode step: [4, 2]" in text


def test_a_real_walk(tiny_ckpt, tmp_path):
    res = walk_request.walk(ROOT, Path(tiny_ckpt("flash", 0)), "configs/tiny-flash.yaml", 4, walk_request.STEP,
                            tmp_path)
    assert {"gateway", "prefill", "decode", "launcher"} <= set(res)
    assert res["request"]["chunks"] >= 2
    for role in ("gateway", "prefill", "decode"):
        assert res[role]["hops"] > 0 and res[role]["files"], role
    assert not any(f.startswith(("engine/model/", "engine/ops/")) for f in res["gateway"]["files"])
    step = res["decode"]["step"]
    assert res["decode"]["step_hops"] and step["hops"] > 0
    assert step["files"][0] == "engine/core/llm_engine.py" and "engine/model/transformer.py" in step["files"]
