"""A 2-rank decode instance in graph mode (exe_mode npugraph_ex: torch.compile on CPU, gloo)
behind real ``launch-pd`` processes, with MTP (next_n 3): both ranks compile one decode step with
its collectives inside (attention DP, expert parallel, embedding / o_proj TP with fixed row counts)
that verifies each rank's spans, and its streams carry the single-process eager next_n 0 engine's
tokens, also while one rank has no request. One instance covers both: a cold compile of two ranks
on 2 shared cores is minutes, and the span-1 step's compile is test_graph_decode's (one rank) and
its collectives are these."""
from __future__ import annotations

import httpx
import yaml

from engine.build import build_engine
from engine.run_config import RunConfig

from pd_util import assert_completions_match, start_pd, wait_idle

MTP_CONFIG = "configs/tiny-flash-mtp.yaml"

DECODE2 = "configs/tiny-flash-2rank-decode.yaml"


def _cut(path: str, out, **model_config):
    """``path``'s run config cut to the first 3 layers (SWA, SWA, CSA: the window, the compressor and
    the indexer under DP rows; the HCA layer adds no collective, only a quarter of two cold
    compiles), with ``model_config`` set; written to ``out``."""
    raw = yaml.safe_load(open(path))
    raw["model_config"].setdefault("custom_params", {})["num_hidden_layers"] = 3
    raw["model_config"].update(model_config)
    out.write_text(yaml.safe_dump(raw))
    return raw


def test_two_rank_graph_decode_with_mtp_streams_the_next_n_0_tokens(ckpt, tmp_path):
    """next_n 3 on both instances (a pair needs the same next_n), the decode in graph mode: each
    DP rank runs its requests' verify spans (1 + 3 tokens) in the compiled step, rolls back its
    rejected drafts (the random model rejects nearly all, closing CSA windows in the tail) and
    drafts from the step's streams; the tokens are the in-process eager next_n 0 engine's: one
    request alone (rank 1 runs padding rows), then four at once (both ranks)."""
    ref = _cut(MTP_CONFIG, tmp_path / "prefill.yaml")
    ref["model_config"]["next_n"] = 0
    reference = build_engine(RunConfig.from_dict(ref), ckpt, progress=False)
    raw = _cut(DECODE2, tmp_path / "decode.yaml", exe_mode="npugraph_ex", next_n=3)
    raw["scheduler_config"]["batch_size"] = 4          # 2 per DP rank: the one CPU bucket
    (tmp_path / "decode.yaml").write_text(yaml.safe_dump(raw))
    pd = start_pd(ckpt, tmp_path / "pd.log", config=str(tmp_path / "prefill.yaml"),
                  instance_args={"decode": ["--config", str(tmp_path / "decode.yaml")]},
                  timeout_s=600)                       # both ranks compile on 2 shared cores: minutes cold
    try:
        health = httpx.get(pd.ready_urls["decode0"].replace("/ready", "/health"), timeout=10).json()
        assert health["exe_mode"] == "npugraph_ex" and health["next_n"] == 3 and health["graph"]["buckets"] == [2]
        assert health["parallel"]["world_size"] == 2 and health["parallel"]["attention"] == "dp"
        # all inside the smallest context bucket (256), the shape both ranks compiled at start-up
        assert_completions_match(pd, reference, [(120, 0.0, 0)], 8)
        assert_completions_match(pd, reference, [(20, 0.0, 1), (131, 0.8, 7), (64, 0.0, 2), (150, 1.0, 11)], 8)
        wait_idle(pd, ["prefill0", "decode0"])
        served = httpx.get(pd.ready_urls["decode0"].replace("/ready", "/health"), timeout=10).json()
        assert served["parallel"]["dp_requests_total"] == [3, 2] and served["spec_decode"]["num_drafts"] > 0
    finally:
        pd.stop()
