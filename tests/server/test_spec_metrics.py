"""A worker whose engine drafts with MTP (next_n > 0) exports vLLM's speculative-decoding counters
under ``dsv4:`` with the engine's ``SpecStats`` values; one without MTP exports none."""
from __future__ import annotations

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.build import build_engine
from engine.core.sampling_params import SamplingParams
from engine.run_config import RunConfig
from server.launch.local import free_port
from server.metrics import WorkerMetrics
from server.workers.base import WorkerOptions
from server.workers.decode import DecodeWorker


def _engine(ckpt, next_n: int):
    raw = yaml.safe_load(open("configs/tiny-flash.yaml"))
    raw["model_config"].update(model_path=str(ckpt), next_n=next_n)
    return build_engine(RunConfig.from_dict(raw), progress=False)


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of every ``dsv4:spec_decode_*`` sample."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples
            if s.name.startswith("dsv4:spec_decode_")}


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    eng = _engine(tiny_ckpt("flash", 1, mtp_agree=True), 3)
    eng.generate([[1000 + 7 * i for i in range(n)] for n in (3, 9)],
                 SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True))
    return eng


def test_decode_worker_exports_the_engines_spec_counters(engine):
    w = DecodeWorker(engine, WorkerOptions(port=free_port(), http_port=0, state_port=free_port()))
    try:
        got = _samples(w.metrics.render())
    finally:
        w.close()
    st = engine.spec.stats
    assert st.num_drafts >= 2 and st.num_accepted_tokens >= 4           # the agreeing model accepted drafts
    lbl = (("model_name", w.opts.model_name), ("role", "decode"))
    want = {("dsv4:spec_decode_num_drafts_total", lbl): st.num_drafts,
            ("dsv4:spec_decode_num_draft_tokens_total", lbl): st.num_draft_tokens,
            ("dsv4:spec_decode_num_accepted_tokens_total", lbl): st.num_accepted_tokens}
    want.update({("dsv4:spec_decode_num_accepted_tokens_per_pos_total", lbl[:1] + (("position", str(p)),) + lbl[1:]):
                 n for p, n in enumerate(st.num_accepted_tokens_per_pos)})
    assert got == want and len(st.num_accepted_tokens_per_pos) == 3


def test_counters_follow_the_engine_between_scrapes(engine):
    """Read at scrape time: later drafts show in the next render without anything feeding them."""
    m = WorkerMetrics("m", "decode")
    m.track_spec(lambda: engine.spec.stats)
    before = _samples(m.render())
    engine.generate([[2000 + 3 * i for i in range(5)]], SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                       ignore_eos=True))
    after = _samples(m.render())
    key = ("dsv4:spec_decode_num_drafts_total", (("model_name", "m"), ("role", "decode")))
    assert after[key] == engine.spec.stats.num_drafts > before[key]


def test_without_mtp_no_spec_series(tiny_ckpt):
    eng = _engine(tiny_ckpt("flash", 1), 0)
    w = DecodeWorker(eng, WorkerOptions(port=free_port(), http_port=0, state_port=free_port()))
    try:
        assert _samples(w.metrics.render()) == {}
    finally:
        w.close()
