"""What a worker states about its model and decode state: the fingerprint and the layout both
sides of a transfer compare (the handshake, and the gateway when it pairs instances:
``kvtransfer.compat``), and the weights label /health shows."""
from __future__ import annotations

import hashlib
import json

from engine.core.llm_engine import LLMEngine
from kvtransfer.wire import model_fingerprint


def quantization_label(q) -> str:
    """The checkpoint's weights: "bf16", the original "fp8-mxfp4" / "fp8", or a dsv4-convert-model type."""
    if q is None:
        return "bf16"
    return q.quant_type or ("fp8-mxfp4" if q.expert_dtype == "fp4" else "fp8")


def state_fingerprint(engine: LLMEngine, weights: str | None = None) -> tuple[str, dict]:
    """The model fingerprint and state layout both sides of a transfer must agree on.

    ``weights``: the checkpoint's weights digest (``engine.checkpoint.digest.weights_digest``:
    "sha256:<hex>"; None: unknown, e.g. an engine built in-process from random weights).
    The layout names what the fingerprint covers, so a refusal (the handshake's, or the gateway's
    when it pairs instances: ``kvtransfer.compat``) says which part differs: ``kv_dtype`` (the
    compute dtype the state is read in), ``cache_dtype`` (how the KV and indexer caches are
    stored and travel: ``engine.cache_dtype``), ``config`` (sha256 of config.json's keys, 16 hex),
    ``weights``, ``next_n`` (MTP draft tokens per step, only when > 0: a prefill running MTP
    ships its MTP window rows and drafts with the commit, ``kvtransfer.wire``, which only a decode
    running the same depth takes; absent, it reads as 0, so a next_n 0 layout and fingerprint are
    those of a build without MTP); then the state's own format.

    ``parallel.state`` "whole": a request's state travels unsharded from the prefill leader to the
    decode leader (every rank holds it whole: attention is not sharded), so instances of any
    parallel layouts pair (prefill CP 2 -> decode EP 2, ...). A sharded state would name its
    sharding here and be refused at the handshake (``kvtransfer.interfaces``), never mid-transfer.
    """
    a = engine.model.args
    config = a.to_dict()
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str).encode()
    layout = {"state_format": 1, "sliding_window": a.sliding_window, "compress_ratios": list(a.compress_ratios),
              "parallel": {"state": "whole"}, "kv_dtype": str(engine.model.dtype).removeprefix("torch."),
              "cache_dtype": engine.cache.config.cache_dtype.describe(),
              "config": hashlib.sha256(blob).hexdigest()[:16], "weights": weights}
    if engine.spec is not None:
        layout["next_n"] = engine.spec.next_n
    return model_fingerprint(config, engine.model.dtype, layout), layout
