"""Multi-rank execution of one instance: the leader schedules, the followers replay.

The leader (rank 0) runs the whole ``LLMEngine``: scheduler, sampler, block manager. Its state
pools are replicated on every rank (attention runs on the same rows everywhere; experts, the
embedding, the LM head and o_proj are sharded, ``engine.parallel.shard``), so the followers only
need, in order, the cache calls that change the pools (allocate, free, a loaded state) and the
model calls that carry collectives (forward, logits, context-parallel prefill). ``Mirror`` hooks
those calls on the leader and sends each as one step message (``link.LeaderLink``) before running
it; ``follow`` replays them on a follower. The block manager is deterministic, so replaying the
same allocate / free sequence gives every rank the same block tables (vLLM's multiproc executor
broadcasts its scheduler output the same way).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os

import torch

from engine.core.pd_state import check_state_tensors, layer_state_tensors, load_state_tensors
from engine.core.llm_engine import RequestError
from engine.parallel.dp_cache import DPCache
from engine.parallel.link import FollowerLink, LeaderLink, decode, encode

log = logging.getLogger(__name__)


def cache_layout(engine) -> dict:
    """What every rank must agree on (exchanged in the hello): the state pools, and a digest of
    weights no layout shards (final norm, layer 0's attention query-down projection and the last
    layer's router), so a rank loaded from another checkpoint is refused."""
    c, m = engine.cache.config, engine.model
    h = hashlib.sha256()
    for t in (m.norm.weight, m.layers[0].attn.wq_a.weight, m.layers[-1].ffn.gate.weight):
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return {"block_size": c.block_size, "max_seqs": c.max_seqs, "num_blocks": dict(sorted(c.num_blocks.items())),
            "next_n": c.next_n, "dtype": str(m.dtype), "weights": h.hexdigest()[:16]}


class Mirror:
    """Leader side: hooks ``engine``'s cache and model so each call reaches the followers first.

    ``cp_prefill``: a context-parallel prefill function (``engine.parallel.cp.cp_prefill``) used
    for a prefill chunk that starts a prompt and has at least ``cp_min_tokens`` tokens; None: never.
    ``dp`` > 1: attention data parallel (decode): the engine's cache becomes a ``DPCache`` whose
    requests each live on one rank, every rank runs its own requests' rows (the model in "dp"
    row mode) and the leader gathers their last hidden rows; the engine's batch limit becomes
    ``dp`` x its own. A cache call carries its owner rank (None: every rank).
    """

    def __init__(self, engine, link: LeaderLink, cp_prefill=None, cp_min_tokens: int = 1024, dp: int = 1):
        self.engine, self.link, self.dp = engine, link, dp
        self.cp_prefill, self.cp_min_tokens = cp_prefill, cp_min_tokens
        self.pending: list = []             # cache calls not yet sent: [op, args..., owner rank]
        self.frames: list[bytes] = []
        self.cp_runs = 0
        if dp > 1:
            engine.cache = engine.scheduler.cache = DPCache(engine.cache, dp)
            engine.limits = engine.scheduler.limits = dataclasses.replace(
                engine.limits, batch_size=engine.limits.batch_size * dp)
        cache, model = engine.cache, engine.model
        alloc, free, load = cache.allocate, cache.free, engine.load_state
        fwd, logits = model.forward_batch, model.logits
        owner = cache.rank_of if dp > 1 else (lambda _: None)

        self.dp_placed = [0] * dp           # requests placed on each DP rank so far

        def allocate(seq_id, num_tokens):
            new = dp > 1 and seq_id not in cache.owner
            held = alloc(seq_id, num_tokens)
            if new:
                self.dp_placed[cache.rank_of(seq_id)] += 1
            self.pending.append(["alloc", seq_id, num_tokens, owner(seq_id)])
            return held

        def free_(seq_id):
            r = owner(seq_id) if seq_id in cache.seqs else None
            free(seq_id)
            self.pending.append(["free", seq_id, r])

        def load_state(request_id, tensors, layers=None):
            L = len(engine.reserved[request_id].prompt_ids)
            r = owner(request_id)
            if r is None:
                load(request_id, tensors, layers)
            else:                         # rank 0 writes its own; another rank's are checked here
                try:
                    if r == 0:
                        load_state_tensors(cache.ranks[0], request_id, L, tensors, layers)
                        return
                    check_state_tensors(cache, L, tensors, layers)
                except ValueError as e:
                    raise RequestError(f"state: {e}") from None
            metas, frames = [], []
            for name, t in tensors.items():
                meta, buf = encode(t)
                metas.append([name, *meta])
                frames.append(buf)
            op = ["load", request_id, L, metas, layers, r]
            if r is None:
                self.pending.append(op)
                self.frames += frames
            else:                         # the bytes go to the owner only, after the calls before
                self._send({"op": "cache"}, [])
                self.link.send({"op": "cache", "cache": [op]}, frames, to=r)

        def forward(tokens, states, lengths, layer_hook=None):
            if dp > 1:
                return self._forward_dp(fwd, tokens, states, lengths, layer_hook)
            meta, buf = encode(tokens)
            self._send({"op": "forward", "seqs": self._seq_ids(states), "nums": [st.num_tokens for st in states],
                        "lengths": list(lengths), "tokens": meta}, [buf])
            return fwd(tokens, states, lengths, layer_hook=layer_hook)

        def forward_batch(tokens, states, lengths, layer_hook=None):
            cp = [i for i, (st, n) in enumerate(zip(states, lengths)) if self._use_cp(st, n)]
            with self._failing("forward"):
                if not cp:
                    return forward(tokens, states, lengths, layer_hook)
                return self._with_cp(forward, cp, tokens, states, lengths, layer_hook)

        def logits_(hidden):
            with self._failing("logits"):
                meta, buf = encode(hidden)
                self._send({"op": "logits", "hidden": meta}, [buf])
                return logits(hidden)

        self._fwd, self._logits = fwd, logits
        cache.allocate, cache.free, engine.load_state = allocate, free_, load_state
        model.forward_batch, model.logits = forward_batch, logits_

    on_failure = None                     # (reason) -> None: a step failed on some rank

    @contextlib.contextmanager
    def _failing(self, what: str):
        """A step that raises other than ValueError (a collective with a lost rank, a gone
        follower) fails the instance before the engine sees it, so its samples are not reported
        as finished (``on_failure``: the worker stops answering and exits)."""
        try:
            yield
        except ValueError:
            raise
        except Exception as e:
            if self.on_failure is not None:
                self.on_failure(f"{what} failed: {type(e).__name__}: {str(e)[:200]}")
            raise

    def _seq_ids(self, states) -> list:
        by_held = {id(h): sid for sid, h in self.engine.cache.seqs.items()}
        return [by_held[id(st.held)] for st in states]

    def _send(self, header: dict, frames: list[bytes]) -> None:
        header["cache"], frames = self.pending, self.frames + frames
        self.pending, self.frames = [], []
        self.link.send(header, frames)

    def _forward_dp(self, fwd, tokens, states, lengths, layer_hook) -> torch.Tensor:
        """Each rank runs its own requests' rows; returns ``[T, H]`` with each sequence's last row
        (the others zero: the engine reads only last rows)."""
        if layer_hook is not None:
            raise ValueError("attention DP serves decode: no layer hook")
        m, cache = self.engine.model, self.engine.cache
        seqs = self._seq_ids(states)
        offs = [0]
        for n in lengths:
            offs.append(offs[-1] + n)
        mine = [[i for i, sid in enumerate(seqs) if cache.rank_of(sid) == r] for r in range(self.dp)]
        parts, frames = [], []
        for r in range(1, self.dp):
            idx = _rows(mine[r], offs)
            meta, buf = encode(tokens[idx])
            parts.append({"seqs": [seqs[i] for i in mine[r]], "nums": [states[i].num_tokens for i in mine[r]],
                          "lengths": [lengths[i] for i in mine[r]], "tokens": meta})
            frames.append(buf)
        self._send({"op": "forward_dp", "parts": parts}, frames)
        idx = _rows(mine[0], offs)
        own = [lengths[i] for i in mine[0]]
        last = _dp_forward(m, fwd, tokens[idx], [states[i] for i in mine[0]], own)
        hidden = torch.zeros(tokens.shape[0], m.args.hidden_size, dtype=m.dtype, device=tokens.device)
        order = [i for r in range(self.dp) for i in mine[r]]
        hidden[torch.tensor([offs[i + 1] - 1 for i in order], dtype=torch.long)] = last
        return hidden

    def _use_cp(self, state, n: int) -> bool:
        """A prefill chunk that starts the prompt and is long enough to split over the CP ranks."""
        return self.cp_prefill is not None and state.num_tokens == 0 and n >= self.cp_min_tokens

    def _with_cp(self, forward, cp: list[int], tokens, states, lengths, layer_hook) -> torch.Tensor:
        """The batch's sequences ``cp`` through context-parallel prefill one by one (upstream's
        cp_mini_batch 1), then the others in one forward. A CP sequence's hidden rows are zero but
        its last (the engine reads only that one for a finished prompt)."""
        m = self.engine.model
        offs = [0]
        for n in lengths:
            offs.append(offs[-1] + n)
        hidden = torch.zeros(tokens.shape[0], m.args.hidden_size, dtype=m.dtype, device=tokens.device)
        seqs = self._seq_ids(states)
        for i in cp:
            toks = tokens[offs[i]:offs[i + 1]]
            meta, buf = encode(toks)
            self._send({"op": "cp", "seq": seqs[i], "tokens": meta}, [buf])
            hidden[offs[i + 1] - 1] = run_cp(self.engine, self.cp_prefill, toks, seqs[i])[-1]
            self.cp_runs += 1
        rest = [i for i in range(len(states)) if i not in cp]
        if rest:          # the CP states are final now: a layer hook may read them with the others'
            idx = torch.cat([torch.arange(offs[i], offs[i + 1], device=tokens.device) for i in rest])
            hidden[idx] = forward(tokens[idx], [states[i] for i in rest], [lengths[i] for i in rest], layer_hook)
        elif layer_hook is not None:
            for layer in range(len(m.layers)):
                layer_hook(layer)
        return hidden

    def stop(self) -> None:
        """Tell the followers to exit (best effort)."""
        try:
            self._send({"op": "stop"}, [])
        except Exception:                 # noqa: BLE001 - they may be gone already
            pass


def sequence_state_tensors(st, num_tokens: int) -> dict[str, torch.Tensor]:
    """A contiguous ``SequenceState`` after ``num_tokens`` tokens as ``cache.state_tensors`` names
    (what ``load_state_tensors`` writes into paged pools; reference §4)."""
    out = {}
    for l, layer in enumerate(st.layers):
        W = layer.win_kv.shape[0]
        n = min(num_tokens, W - 1)
        win = layer.win_kv[torch.arange(num_tokens - n, num_tokens, device=layer.win_kv.device) % W]
        out.update(layer_state_tensors(l, layer, win, num_tokens))
    return out


def run_cp(engine, cp_prefill, tokens: torch.Tensor, seq_id) -> torch.Tensor:
    """Every rank: CP prefill of ``tokens`` (a whole prompt), then write the full state into this
    rank's pools for ``seq_id`` (already allocated). Returns the last hidden row ``[1, H]``."""
    last, state = cp_prefill(engine.model, tokens, gather_hidden=False)
    n = tokens.shape[0]
    load_state_tensors(engine.cache, seq_id, n, sequence_state_tensors(state, n))
    return last


def _rows(seqs: list[int], offs: list[int]) -> torch.Tensor:
    """Packed row indices of sequences ``seqs`` (``offs``: sequence start offsets + the end)."""
    if not seqs:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(offs[i], offs[i + 1]) for i in seqs])


def _dp_forward(model, fwd, tokens: torch.Tensor, states: list, lengths: list[int]) -> torch.Tensor:
    """Every rank (attention DP): its own sequences (none: zero rows, still every collective),
    then every rank's last rows, all ranks' in rank order ``[sum over ranks of sequences, H]``."""
    from engine.parallel.comm import gather_rows
    with model.parallel.rows("dp"):
        h = fwd(tokens, states, lengths)
    ends = torch.tensor(lengths, dtype=torch.long).cumsum(0) - 1
    return gather_rows(h[ends], model.parallel.groups["moe"])[0]


def follow(engine, link: FollowerLink, cp_prefill=None, rank: int = 0) -> None:
    """A follower's loop: replay the leader's step messages until ``stop``.

    A ValueError from the model is the leader's too (same inputs, raised before any collective):
    logged and skipped. Any other failure leaves this rank out of step: the process exits (1),
    which takes the instance out of routing (the leader sees the connection close).
    """
    cache, model = engine.cache, engine.model
    while True:
        head, frames = link.recv()
        try:
            k = 0
            for op in head.get("cache", ()):
                if op[-1] not in (None, rank):       # another DP rank's request
                    continue
                if op[0] == "alloc":
                    cache.allocate(op[1], op[2])
                elif op[0] == "free":
                    cache.free(op[1])
                elif op[0] == "load":
                    _, rid, n, metas, layers, _ = op
                    tensors = {}
                    for name, *meta in metas:
                        tensors[name] = decode(meta, frames[k])
                        k += 1
                    load_state_tensors(cache, rid, n, tensors, layers)
            kind = head["op"]
            if kind == "forward":
                tokens = decode(head["tokens"], frames[k])
                states = [cache.sequence_state(s, n) for s, n in zip(head["seqs"], head["nums"])]
                try:
                    model.forward_batch(tokens, states, head["lengths"])
                except ValueError as e:
                    log.warning("forward refused on every rank: %s", e)
            elif kind == "forward_dp":
                p = head["parts"][rank - 1]
                states = [cache.sequence_state(s, n) for s, n in zip(p["seqs"], p["nums"])]
                _dp_forward(model, model.forward_batch, decode(p["tokens"], frames[k + rank - 1]), states,
                            p["lengths"])
            elif kind == "logits":
                model.logits(decode(head["hidden"], frames[k]))
            elif kind == "cp":
                run_cp(engine, cp_prefill, decode(head["tokens"], frames[k]), head["seq"])
            elif kind == "stop":
                return
        except Exception:                 # noqa: BLE001 - out of step with the leader: leave
            log.exception("follower out of step with the leader; exiting")
            os._exit(1)
