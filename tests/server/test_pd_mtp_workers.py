"""MTP P/D with the workers on threads over the torch.distributed transport (gloo): the decode
verifies, step by step, exactly the drafts an in-process next_n 3 engine makes (the first step's
drafted on prefill and shipped with the commit, the rest from the MTP window rows shipped with
it), the tokens are that engine's, and the transfer carries reference §4's payload plus the MTP
rows. On the random tiny model drafts are rejected, so only the drafts themselves show that the
MTP state arrived intact. (The ZMQ transport, and the tokens against next_n 0, are
``test_pd_mtp.py``'s, through real processes.)"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import defaultdict

import pytest

from engine.build import build_engine
from engine.core.sampling_params import SamplingParams
from engine.run_config import RunConfig
from pd_util import collect_tokens, rand_prompt, state_payload_bytes
from server.backends.base import GenRequest
from server.backends.pd import PDBackend
from server.launch.local import free_port
from server.workers.base import WorkerOptions
from server.workers.decode import DecodeWorker
from server.workers.prefill import PrefillWorker

MTP_CONFIG = "configs/tiny-flash-mtp.yaml"
CASES = [(20, 0.0, 1), (131, 0.8, 7)]          # (prompt length, temperature, seed)
MAX_TOKENS = 8


def _engine(ckpt):
    return build_engine(RunConfig.from_yaml(MTP_CONFIG), ckpt, progress=False)


def record_drafts(engine, log: dict) -> None:
    """Wrap ``engine.spec.settle`` (instance attribute, this test only: called once per sampled
    row with the drafts that row verified) to append each verify step's drafts to
    ``log[request id]``; behaviour unchanged."""
    settle = engine.spec.settle

    def recording(seq, kept):
        log[seq.seq_id].append(list(seq.draft_ids[: seq.spec_k]))
        return settle(seq, kept)
    engine.spec.settle = recording


def test_dist_pd_decode_verifies_the_in_process_drafts(ckpt):
    ref, want_drafts = _engine(ckpt), defaultdict(list)
    record_drafts(ref, want_drafts)
    reqs = [GenRequest(f"t-{uuid.uuid4().hex}", rand_prompt(n, n),
                       SamplingParams(max_new_tokens=MAX_TOKENS, temperature=t, seed=seed, ignore_eos=True))
            for n, t, seed in CASES]
    want = [ref.generate([r.prompt_ids], r.params)[0] for r in reqs]          # each alone
    prefill = PrefillWorker(_engine(ckpt), WorkerOptions(port=free_port(), http_port=0, transport="dist"))
    decode = DecodeWorker(_engine(ckpt), WorkerOptions(port=free_port(), http_port=0, transport="dist",
                                                       state_port=free_port()))
    got_drafts = defaultdict(list)
    record_drafts(decode.engine, got_drafts)
    threads = [threading.Thread(target=w.run, daemon=True) for w in (prefill, decode)]
    for t in threads:
        t.start()
    try:
        backend = PDBackend([f"127.0.0.1:{prefill.opts.port}"], [f"127.0.0.1:{decode.opts.port}"])
        got = asyncio.run(collect_tokens(backend, reqs))
        for r, g, w in zip(reqs, got, want):
            assert g == w.output_ids, len(r.prompt_ids)
            # in process the first sampling step (prefill's) verifies nothing; every later step's
            # drafts, the first of them made on prefill and shipped with the commit, are decode's
            assert want_drafts[w.seq_id][0] == [] and len(want_drafts[w.seq_id][1]) == 3
            assert got_drafts[r.request_id] == want_drafts[w.seq_id][1:], len(r.prompt_ids)
            t = decode.transfers[r.request_id]
            assert t["layers_before_commit"] == len(decode.engine.model.layers)
            assert t["payload_bytes"] == state_payload_bytes(ref, len(r.prompt_ids))
        assert decode.engine.spec.stats == ref.spec.stats and ref.spec.stats.num_drafts > 0
        end = time.monotonic() + 10
        while time.monotonic() < end and not all(
                e.num_free_blocks() == e.num_total_blocks() and not e.pd.reserved and not e.pd.held
                and not e.has_unfinished() for e in (prefill.engine, decode.engine)):
            time.sleep(0.05)
        for e in (prefill.engine, decode.engine):
            assert e.num_free_blocks() == e.num_total_blocks() and not e.pd.reserved and not e.pd.held
        assert not prefill.jobs and not decode.owners and not decode.table.pending
    finally:
        for w in (prefill, decode):
            w.stop.set()
        for t in threads:
            t.join(10)
        prefill.close()
        decode.close()


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("flash", 1)
