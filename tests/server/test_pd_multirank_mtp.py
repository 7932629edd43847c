"""MTP speculative decoding (next_n 3) on multi-rank instances behind real ``launch-pd`` processes
(gloo): a 2-rank prefill (attention replicated, expert parallel, LM-head TP: both ranks run the
MTP catch-up and chain the drafts in lockstep) and a 2-rank decode (attention DP: each rank
verifies, rolls back and drafts for its own requests, the drafts gathered on the leader). Every
stream is the in-process next_n 0 engine's, and the decode verifies exactly the drafts an
in-process next_n 3 engine makes. The prefill caches prefixes: sent again, the prompts past 128
tokens start from their boundary state on both ranks, and the streams stay the same."""
from __future__ import annotations

import httpx
import yaml

from engine.build import build_engine
from engine.core.sampling_params import SamplingParams
from engine.run_config import RunConfig
from pd_util import assert_completions_match, rand_prompt, start_pd, wait_idle

MTP_CONFIG = "configs/tiny-flash-mtp.yaml"
# (prompt length, temperature, seed): under the 128-token window and past it (the MTP ring wraps)
CASES = [(20, 0.0, 1), (131, 0.8, 7), (64, 0.0, 2), (150, 1.0, 11)]
MAX_TOKENS = 8


def _config(path: str, out, **parallel) -> str:
    raw = yaml.safe_load(open(path))
    raw["model_config"]["next_n"] = 3
    raw["parallel_config"].update(parallel)
    out.write_text(yaml.safe_dump(raw))
    return str(out)


def _health(pd, name: str) -> dict:
    return httpx.get(pd.ready_urls[name].replace("/ready", "/health"), timeout=10).json()


def test_two_rank_instances_with_mtp_stream_the_next_n_0_tokens(ckpt, reference, tmp_path):
    prefill = _config("configs/tiny-flash-2rank-prefill.yaml", tmp_path / "prefill.yaml", cp_size=1)
    decode = _config("configs/tiny-flash-2rank-decode.yaml", tmp_path / "decode.yaml")
    pd = start_pd(ckpt, tmp_path / "pd.log", config=MTP_CONFIG,
                  instance_args={"prefill": ["--config", prefill, "--enable-prefix-caching"],
                                 "decode": ["--config", decode]})
    try:
        for name in ("prefill0", "decode0"):
            h = _health(pd, name)
            assert h["next_n"] == 3 and h["parallel"]["world_size"] == 2, name
        assert _health(pd, "prefill0")["parallel"]["attention"] == "replicated"
        assert_completions_match(pd, reference, CASES, MAX_TOKENS)        # next_n 0 in process: same ids
        wait_idle(pd, ["decode0"])                # (the prefill keeps its prefix-cache entries)
        dec = _health(pd, "decode0")
        assert dec["parallel"]["attention"] == "dp" and min(dec["parallel"]["dp_requests_total"]) >= 1, dec
        # the drafts each request verified are those an in-process next_n 3 engine makes for it alone
        eng = build_engine(RunConfig.from_yaml(MTP_CONFIG), ckpt, progress=False)
        for n, temperature, seed in CASES:
            eng.generate([rand_prompt(n, n)], SamplingParams(max_new_tokens=MAX_TOKENS, temperature=temperature,
                                                             seed=seed, ignore_eos=True))
        st = eng.spec.stats
        assert st.num_drafts > 0
        assert dec["spec_decode"] == {"num_drafts": st.num_drafts, "num_draft_tokens": st.num_draft_tokens,
                                      "num_accepted_tokens": st.num_accepted_tokens,
                                      "num_accepted_tokens_per_pos": st.num_accepted_tokens_per_pos}
        assert _health(pd, "prefill0")["prefix_cache"]["hits"] == 0
        assert_completions_match(pd, reference, CASES, MAX_TOKENS)        # again: the 131 / 150 prompts hit 128
        wait_idle(pd, ["decode0"])
        assert _health(pd, "prefill0")["prefix_cache"]["hits"] == 2 * 128
        url = pd.ready_urls["prefill0"].replace("/ready", "/reset_prefix_cache")
        assert httpx.post(url, timeout=10).json()["evicted"] >= 2
        wait_idle(pd, ["prefill0", "decode0"])    # on both ranks (rank 1 with the next step: none comes)
    finally:
        pd.stop()
