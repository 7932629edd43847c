"""Multi-rank instances behind the gateway (real processes, gloo): a 2-rank prefill (zig-zag
context parallel + expert parallel + LM-head TP) and a 2-rank decode (expert parallel + embedding /
LM-head / o_proj TP) give the single-process engine's tokens, also when the prefill starts from
its cached prefixes (context-parallel chunks ending at the boundaries it keeps); losing a rank takes its instance out
of routing in bounded time while the gateway serves through the others."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from openai import OpenAI

from engine.core.sampling_params import SamplingParams
from tests.pd_util import assert_completions_match, rand_prompt, start_pd, wait_idle

PREFILL2 = ["--config", "configs/tiny-flash-2rank-prefill.yaml"]
DECODE2 = ["--config", "configs/tiny-flash-2rank-decode.yaml"]


def _health(pd, name: str) -> dict:
    return httpx.get(pd.ready_urls[name].replace("/ready", "/health"), timeout=5).json()


def _both_healthy(pd) -> bool:
    h = httpx.get(pd.base_url + "/health", timeout=5).json()
    return len(h["healthy_prefill"]) == 2 and len(h["healthy_decode"]) == 2


def _gone(pid: int) -> bool:
    """Exited (a zombie no one has reaped yet counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def _wait(cond, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def test_two_rank_prefill_and_decode_equal_the_single_process_engine(ckpt, reference, tmp_path):
    pd = start_pd(ckpt, tmp_path / "pd.log", instance_args={"prefill": PREFILL2 + ["--enable-prefix-caching"],
                                                            "decode": DECODE2})
    try:
        for name in ("prefill0", "decode0"):
            par = _health(pd, name)["parallel"]
            assert par["world_size"] == 2 and [r["rank"] for r in par["ranks"]] == [0, 1]
            assert all(not _gone(r["pid"]) for r in par["ranks"])
        # >= 2 * cp_size * 128 tokens: context-parallel prefill; 2200 > max_prefill_tokens (2048): a
        # CP first chunk, then an ordinary one; the short ones run on both ranks whole
        cases = [(600, 0.0, None), (700, 0.9, 7), (50, 0.0, None), (130, 0.8, 3), (2200, 0.0, None)]
        assert_completions_match(pd, reference, cases, max_tokens=6)
        assert _health(pd, "prefill0")["parallel"]["cp_prefills"] >= 2
        dec = _health(pd, "decode0")["parallel"]
        assert dec["attention"] == "dp" and min(dec["dp_requests_total"]) >= 1, dec    # both ranks decoded
        wait_idle(pd, ["decode0"])
        assert _health(pd, "prefill0")["prefix_cache"]["hits"] == 0
        assert_completions_match(pd, reference, cases, max_tokens=6)       # again: from each last boundary
        wait_idle(pd, ["decode0"])
        assert _health(pd, "prefill0")["prefix_cache"]["hits"] == 512 + 640 + 128 + 2176
        url = pd.ready_urls["prefill0"].replace("/ready", "/reset_prefix_cache")
        assert httpx.post(url, timeout=10).json()["evicted"] >= 4
        wait_idle(pd, ["prefill0", "decode0"])
    finally:
        pd.stop()


def _serve(client, n: int, seed: int, reference) -> None:
    prompt = rand_prompt(n, seed)
    r = client.completions.create(model="deepseek_v4", prompt=prompt, max_tokens=4, temperature=0.0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    want = reference.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    assert r.choices[0].model_extra["token_ids"] == want[0].output_ids


def _stream(client, seed: int, outcome: list) -> None:
    try:
        for _ in client.completions.create(model="deepseek_v4", prompt=rand_prompt(30, seed), max_tokens=48,
                                           temperature=0.0, stream=True, extra_body={"ignore_eos": True}):
            pass
        outcome.append("done")
    except Exception as e:                # noqa: BLE001 - the outcome is what the test checks
        outcome.append(f"{type(e).__name__}: {e}")


def test_a_lost_rank_takes_its_instance_out_and_the_gateway_serves_through_the_others(ckpt, reference, tmp_path):
    # default heartbeat timeouts: a kill -9 closes the connections, which is seen at once; a 2 s
    # timeout on a loaded 2-core CI machine risks a false loss before the kill
    pd = start_pd(ckpt, tmp_path / "pd.log", num_prefill=2, num_decode=2,
                  instance_args={"prefill0": PREFILL2, "decode0": DECODE2})
    client = OpenAI(base_url=pd.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    try:
        # the gateway is healthy with one pair; the 2-rank instances may still be loading
        _wait(lambda: _both_healthy(pd), 120, "all four instances in routing")
        for i in range(4):
            _serve(client, 40 + i, i, reference)
        # kill -9 a follower while streams run: its leader leaves (exits 1) within the rank timeout
        # and a bit; every stream ends (all its tokens, or an error event), none hangs
        outcome: list[str] = []
        streams = [threading.Thread(target=_stream, args=(client, 80 + i, outcome)) for i in range(4)]
        for t in streams:
            t.start()
        time.sleep(1.0)
        assert pd.procs["decode0"].poll() is None, "decode0 exited before its rank was killed (see its log)"
        follower = _health(pd, "decode0")["parallel"]["ranks"][1]["pid"]
        os.kill(follower, signal.SIGKILL)
        took = _wait(lambda: pd.procs["decode0"].poll() is not None, 20, "decode0's leader exits")
        assert pd.procs["decode0"].returncode == 1
        for t in streams:
            t.join(60)
        assert not any(t.is_alive() for t in streams) and len(outcome) == 4, outcome
        assert all(o == "done" or "disconnected" in o for o in outcome), outcome
        # kill -9 a leader: its follower exits too (no orphan holding the devices)
        follower = _health(pd, "prefill0")["parallel"]["ranks"][1]["pid"]
        pd.signal("prefill0", signal.SIGKILL)
        _wait(lambda: _gone(follower), 20, "prefill0's follower exits")
        for i in range(6):
            _serve(client, 60 + i, 10 + i, reference)
        wait_idle(pd, ["prefill1", "decode1"])
        print(f"decode0 left {took:.2f} s after its rank 1 was killed; streams: {outcome}")
    finally:
        pd.stop()
