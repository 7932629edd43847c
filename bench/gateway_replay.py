"""The gateway under test of ``dsv4-bench gateway`` (``bench.bench_gateway``): one fixed, realistic
thinking-mode reply (reasoning with some Chinese and an emoji, ``</think>``, answer) as token ids, the
``ReplayBackend`` that replays it in place of the workers one token per event, the app built on it,
and the child process that serves it (``--serve``).
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

MODEL_NAME = "deepseek-v4-flash"

# A realistic thinking-mode reply. English with some Chinese and an emoji: multi-byte characters
# split over byte-level BPE tokens exercise the detokeniser's hold-back, as real replies do.
REASONING = (
    "The user asks how to make a distributed cache survive a node failure without losing writes. "
    "Let me think about what they actually need. A cache is usually allowed to lose data, but they said "
    "writes, so this is closer to a write-back cache, where the cache is the only copy for a while. "
    "Options: replicate every write to a second node before acknowledging it (synchronous replication), "
    "or write ahead to a durable log and replay it on restart. Synchronous replication doubles the "
    "network traffic per write but keeps latency low if the replica is in the same rack; the log costs "
    "an fsync per batch. 用户可能在中文环境里部署，所以我应该把关键术语也用中文说明：同步复制、预写日志、"
    "一致性哈希。 Consistent hashing matters too: when a node fails, only its key range moves, so the "
    "warm-up after a failure touches 1/N of the keys instead of all of them. I should also mention "
    "quorum reads (R + W > N) because otherwise a read right after failover can return a stale value. "
    "Edge cases: a network partition where both sides think they are primary (split brain) needs "
    "fencing tokens or a lease; clock skew breaks lease-based approaches unless the lease is generous. "
    "Let me structure the answer: the short recommendation first, then the two designs, then the "
    "failure cases, then a small configuration example. Keep it practical. 🙂 "
)
ANSWER = (
    "**Short answer:** replicate each write synchronously to one replica in a different failure domain "
    "before acknowledging it, and place keys with consistent hashing so a failure only moves 1/N of "
    "them.\n\n## Two designs\n\n1. **Synchronous replication (同步复制).** The primary forwards the write "
    "to its replica and acknowledges the client only after the replica confirms. Cost: one extra "
    "round trip inside the rack, typically 100 to 300 microseconds.\n2. **Write-ahead log (预写日志).** "
    "Each node appends writes to a local log, fsynced in batches every few milliseconds, and replays it "
    "after a restart. Cost: you lose at most one batch if the disk survives, everything if it does not."
    "\n\n## Failure cases\n\n- **Split brain:** use fencing tokens; a stale primary's writes are "
    "rejected by the storage layer.\n- **Stale reads after failover:** use quorum reads and writes "
    "(R + W > N), for example N = 3, W = 2, R = 2.\n- **Hot keys:** replicate them to more nodes and "
    "read from any replica.\n\n## Example\n\n```yaml\nreplication_factor: 3\nwrite_quorum: 2\n"
    "read_quorum: 2\nlog_fsync_interval_ms: 5\n```\n\nStart with synchronous replication; add the log "
    "only if you must survive losing a whole rack. 🚀"
)
THINK_END = "</think>"


# ---- the fake backend --------------------------------------------------------------------------------
def _fit(tok, text: str, n: int) -> list[int]:
    """Exactly ``n`` token ids of ``text`` (repeated as needed). A cut inside a multi-byte character
    is patched with "." tokens, so the replay never ends a part with a broken character."""
    ids = tok.encode(text)
    if not ids or n <= 0:
        return []
    ids = (ids * (n // len(ids) + 1))[:n]
    dot = tok.encode(".")[0]
    k = n
    while k > 0 and tok.decode(ids[:k]).endswith("\ufffd"):
        k -= 1
    return ids[:k] + [dot] * (n - k)


def reply_ids(tok, tokens: int, reasoning: str = REASONING, answer: str = ANSWER) -> list[int]:
    """``tokens`` ids: reasoning, the ``</think>`` token, answer, split in proportion to the two texts'
    own lengths. ``tokens`` 0: the texts as they are."""
    r, a = tok.encode(reasoning), tok.encode(answer)
    end = tok.encode(THINK_END)
    if not tokens:
        return r + end + a
    n_r = round((tokens - len(end)) * len(r) / (len(r) + len(a)))
    return _fit(tok, reasoning, n_r) + end + _fit(tok, answer, tokens - len(end) - n_r)


class ReplayBackend:
    """A ``server.backends.base.Backend`` that answers every sample with ``token_ids`` (capped at the
    sample's max_new_tokens), one token per event, the last with finish_reason "length". Between
    events it yields to the event loop once, so concurrent streams interleave as they would with a
    decode worker emitting one token per step for the whole batch."""

    def __init__(self, token_ids: list[int], max_model_len: int = 1 << 20):
        self.token_ids, self._max_len = list(token_ids), max_model_len

    async def generate(self, req):
        from server.backends.base import TokenEvent
        ids = self.token_ids[:req.params.max_new_tokens]
        last = len(ids) - 1
        for i, t in enumerate(ids):
            yield TokenEvent([t], finished=i == last, finish_reason="length" if i == last else None,
                             num_prompt_tokens=len(req.prompt_ids), queue_time_s=0.0 if i == 0 else None)
            await asyncio.sleep(0)

    async def health(self) -> dict:
        return {"healthy": True}

    @property
    def max_model_len(self) -> int:
        return self._max_len

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


def build_app(model_dir: str | Path, name: str, token_ids: list[int]):
    """The gateway app under test: the ONE place that knows ``create_app``'s signature.

    Today: ``create_app(backend, engine.tokenizer.Tokenizer(model_dir), name)``. When the chat path
    moves to ``deepseek_recipe`` and the second argument becomes the checkpoint directory (or a format
    object built from it), the parameter's name decides which is passed; adapt here only."""
    import inspect

    from server.gateway.app import create_app
    backend = ReplayBackend(token_ids)
    second = list(inspect.signature(create_app).parameters)[1]
    if second == "tokenizer":
        from engine.tokenizer import Tokenizer
        return create_app(backend, Tokenizer(model_dir), name)
    return create_app(backend, str(model_dir), name)     # the new signature: the checkpoint directory


def serve(args) -> int:
    """The child: tokenise the reply, print one JSON line (tokens per stream), serve until killed."""
    import uvicorn

    from engine.tokenizer import Tokenizer
    reasoning, answer = REASONING, ANSWER
    if args.reply_file:
        reasoning, _, answer = Path(args.reply_file).read_text(encoding="utf-8").partition(THINK_END)
    ids = reply_ids(Tokenizer(args.model), args.tokens_per_stream, reasoning, answer)
    app = build_app(args.model, MODEL_NAME, ids)
    print(json.dumps({"tokens": len(ids)}), flush=True)
    # the same uvicorn settings as the production gateway (server/launch/roles.py)
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning",
                                  access_log=False)).run()
    return 0
