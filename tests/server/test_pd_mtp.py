"""MTP speculative decoding (next_n 3) through real ``launch-pd`` processes (issue 24): the prefill
ships the MTP window rows and the drafts with its commit, the decode verifies them, and every
stream is token for token the in-process next_n 0 engine's (greedy and seeded sampling). A decode
running another next_n (here 0) beside it is never paired, its cause named ``next_n``.

One cluster for the module: prefill0 and decode0 on configs/tiny-flash-mtp.yaml, decode1 on
configs/tiny-flash.yaml (next_n 0)."""
from __future__ import annotations


import httpx
import pytest

from engine.build import build_engine
from engine.core.sampling_params import SamplingParams
from engine.core.spec_decode import SpecStats
from engine.run_config import RunConfig
from pd_util import (CONFIG, assert_completions_match, rand_prompt, start_pd, state_payload_bytes, wait_idle,
                     wait_incompatible_pair)

MTP_CONFIG = "configs/tiny-flash-mtp.yaml"
WORKERS = ("prefill0", "decode0", "decode1")
# (prompt length, temperature, seed): one under the 128-token window, one past it (the MTP ring wraps)
CASES = [(20, 0.0, 1), (131, 0.8, 7)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(ckpt, tmp_path_factory):
    pd = start_pd(ckpt, tmp_path_factory.mktemp("pd-mtp") / "pd.log", num_decode=2, config=MTP_CONFIG,
                  instance_args={"decode1": ["--config", CONFIG]})
    yield pd
    pd.stop()


def _health(pd, name: str) -> dict:
    return httpx.get(pd.ready_urls[name].replace("/ready", "/health"), timeout=10).json()


def _metric(pd, name: str, metric: str, **labels) -> float:
    """The sum of ``dsv4:<metric>``'s series of process ``name`` that carry ``labels``."""
    total = 0.0
    for line in httpx.get(pd.metrics_urls[name], timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            if series.partition("{")[0] == "dsv4:" + metric and all(f'{a}="{b}"' in series for a, b in labels.items()):
                total += float(value)
    return total


def _mtp_reference(ckpt) -> tuple[SpecStats, int]:
    """An in-process next_n 3 engine's spec-decode counts over ``CASES``, each run alone, and the
    state bytes their P/D transfers must carry (reference §4 with the MTP window rows)."""
    eng = build_engine(RunConfig.from_yaml(MTP_CONFIG), ckpt, progress=False)
    for n, temperature, seed in CASES:
        eng.generate([rand_prompt(n, n)], SamplingParams(max_new_tokens=MAX_TOKENS, temperature=temperature,
                                                         seed=seed, ignore_eos=True))
    assert eng.model.args.sliding_window - 1 < CASES[-1][0]                # the last case fills the ring
    return eng.spec.stats, sum(state_payload_bytes(eng, n) for n, _, _ in CASES)


def test_mtp_streams_are_the_in_process_next_n_0_tokens_and_carry_the_mtp_state(cluster, reference, ckpt):
    for name, next_n in (("prefill0", 3), ("decode0", 3), ("decode1", 0)):
        h = _health(cluster, name)
        assert h["next_n"] == next_n, name
        assert cluster.ready(name)["handshake"]["layout"].get("next_n", 0) == next_n, name
    assert _health(cluster, "decode0")["spec_decode"]["num_drafts"] == 0
    assert _health(cluster, "decode1")["spec_decode"] is None
    assert_completions_match(cluster, reference, CASES, MAX_TOKENS)        # next_n 0 in process: same ids
    stats, payload = _mtp_reference(ckpt)
    # decode0 verified exactly the drafts an in-process next_n 3 engine does: the first verify
    # step's came with the commit (drafted on prefill), the rest from the MTP ring it shipped
    got = _health(cluster, "decode0")["spec_decode"]
    assert got == {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
                   "num_accepted_tokens": stats.num_accepted_tokens,
                   "num_accepted_tokens_per_pos": stats.num_accepted_tokens_per_pos}
    assert stats.num_drafts > 0
    # the bytes on the wire: the §4 payload with the MTP rows, plus one small header per message
    sent, received = (_metric(cluster, n, "kv_transfer_bytes_total") for n in ("prefill0", "decode0"))
    assert sent == received and 0 < received - payload < 64 << 10, (received, payload)
    wait_idle(cluster, WORKERS)


def test_a_decode_with_another_next_n_is_never_paired(cluster):
    h = wait_incompatible_pair(cluster)
    assert h["healthy"] and h["compatible_pairs"] == 1
    [bad] = h["incompatible_pairs"]
    cmd = cluster.cmds["decode1"]
    assert bad["decode"] == f"127.0.0.1:{cmd[cmd.index('--port') + 1]}" and bad["cause"] == "next_n"
    assert bad["reason"] == ("layout.next_n differs: prefill has 3, decode has 0 (MTP draft tokens per step: a "
                             "prefill running MTP ships its MTP window and drafts with the commit; both sides must "
                             "run the same next_n)")
    assert _metric(cluster, "gateway", "incompatible_pairs", cause="next_n") == 1
    assert _metric(cluster, "gateway", "incompatible_pairs") == 1
    # what the first test sent went to decode0 only
    assert _metric(cluster, "decode1", "prompt_tokens_total") == 0
    assert _metric(cluster, "decode1", "kv_transfer_bytes_total") == 0
    assert _metric(cluster, "decode0", "prompt_tokens_total") == sum(n for n, _, _ in CASES)
    wait_idle(cluster, WORKERS)
