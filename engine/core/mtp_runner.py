"""The model runner's MTP side (reference/dsv4-architecture.md §3.8; the policy is
``engine.core.spec_decode``): the rollback of a step's verify spans, the MTP layer's catch-up and
chained drafts over the trunk's output streams, and the streams a prefix-cache entry carries.

Everything here is per rank: a multi-rank instance's ranks each keep their own streams and
rollbacks and run the same calls (``DraftPlan`` from the leader), so the MTP layer's collectives
match.
"""
from __future__ import annotations

import torch

from engine.config import CSA_RATIO
from engine.core.step import DraftRow


class SpanRollback:
    """The rollback of every verify span of one decode step (``StaticDecoder``, eager or
    captured), batched: each compressor-state tensor of ``PagedCache.comp_stacks`` (all layers of
    a kind) is read once when the step is made and written once when its spans are settled,
    whatever the batch and layer count.

    Restoring is enough, with no replay: a span of at most m tokens (``MAX_NEXT_N + 1 <=
    CSA_RATIO``) closes at most one window per compressor, at position c. If c is accepted nothing
    needs undoing. If c was rejected, every accepted token lies before c in its window and the
    graph step wrote its row (it stores every token's row), which no later span token shares (rows
    repeat every m positions). What the rejected tokens wrote is then their own rows and, at c,
    CSA's previous-window ``Ca / Za``: restoring those to the saved values is what running only
    the accepted tokens leaves. A rejected row after c, once restored, holds the position m
    before it, older than L and so already stored.

    Args:
        cache: the pools (``PagedCache``). spans: ``(seq_id, state slot, L, span)`` of each request
            verifying drafts (L its tokens before the step).
    """

    def __init__(self, cache, spans: list[tuple[object, int, int, int]]):
        self.spans = {sid: (slot, L, n) for sid, slot, L, n in spans}
        self.kept: dict = {}
        self.done: set = set()
        self.saved = []                      # (tensors, ratio, [seq_id], slots [n], rows [n, span], values)
        dev = cache.device
        for m, tensors in cache.comp_stacks.values():
            close = [(sid, slot, L, n) for sid, slot, L, n in spans if (L + n) // m != L // m]
            if not close:
                continue
            T = max(n for *_, n in close)
            slots = torch.tensor([slot for _, slot, _, _ in close], dtype=torch.long, device=dev)
            rows = torch.tensor([[(L + min(j, n - 1)) % m for j in range(T)] for _, _, L, n in close],
                                dtype=torch.long, device=dev)
            vals = [t[:, slots[:, None], rows] for t in tensors]                  # [layers, n, T, width]
            if m == CSA_RATIO:                  # previous window's Ca / Za (rows m .. 2m, first half)
                vals += [t[:, slots, m:2 * m] for t in tensors]
            self.saved.append((tensors, m, [c[0] for c in close], slots, rows, vals))

    def settle(self, seq_id, kept: int) -> bool:
        """Record that ``kept`` tokens of ``seq_id``'s span were accepted (False: not one of these
        spans). Once every span is settled, ``apply``."""
        if seq_id not in self.spans:
            return False
        self.kept[seq_id] = kept
        if self.kept.keys() >= self.spans.keys():
            self.apply()
        return True

    def drop(self, seq_id) -> None:
        """``seq_id`` ended (its state is freed): nothing of its span is restored."""
        self.spans.pop(seq_id, None)
        self.kept.pop(seq_id, None)

    def apply(self) -> None:
        """Restore what the rejected tails of the spans settled so far wrote (each once); the
        others wait for their ``settle``."""
        todo = {sid: k for sid, k in self.kept.items() if sid not in self.done}
        if not todo:
            return
        for tensors, m, sids, slots, rows, vals in self.saved:
            pick, j_idx = [], []
            for i, sid in enumerate(sids):
                k = todo.get(sid)
                if k is None or sid not in self.spans:
                    continue
                _, L, n = self.spans[sid]
                if (L + k) // m != L // m:
                    continue                 # the closing token was accepted
                pick += [i] * (n - k)
                j_idx += range(k, n)
            if not pick:
                continue
            dev = slots.device
            i_t, j_t = torch.tensor(pick, device=dev), torch.tensor(j_idx, device=dev)
            for t, v in zip(tensors, vals):
                t[:, slots[i_t], rows[i_t, j_t]] = v[:, i_t, j_t]
            if m == CSA_RATIO:
                p_t = torch.tensor(sorted(set(pick)), device=dev)
                for t, v in zip(tensors, vals[2:]):
                    t[:, slots[p_t], m:2 * m] = v[:, p_t]
        self.done |= todo.keys()


@torch.no_grad()
def run_drafts(model, pools, decoder, streams: torch.Tensor, offsets: dict, holdings: dict, carries: dict,
               rows: list[DraftRow], steps: int, parts: tuple[bool, bool] | None = None) -> list[list[int]]:
    """This rank's part of a draft step: the MTP layer over ``rows``' catch-up rows of
    ``streams`` (``[T, n, H]``, the last trunk forward's output streams; ``offsets``: each
    request's first row there; ``holdings``: its ``SeqBlocks``; ``carries``: the carried streams
    ``[n, H]`` of the rows with ``carry``), then ``steps`` greedy drafts chained on the MTP
    layer's own output streams (vLLM's DeepSeek-V4 MTP chaining; chained rows are written to the
    MTP ring but not committed: the next step rewrites them).

    Catch-up spans of at most ``decoder.span`` rows and the chained rows run through the decode
    step (``StaticDecoder.mtp``), longer ones (a prompt's last ``sliding_window``) through
    ``Transformer.forward_mtp``: the same values. ``parts`` (short, long): which of the two run
    even with no rows here (attention DP: every rank makes the same collective calls; None: the
    ones with rows). Returns each row's drafts (``want`` of them; first max on ties). Raises
    ValueError as ``Transformer.forward_mtp``."""
    dev = streams.device if streams is not None else pools.device
    X_parts, toks = [], []
    for r in rows:
        base = offsets[r.req_id] + r.row0
        if r.carry:
            X_parts.append(carries[r.req_id][None].to(dev, streams.dtype))
        X_parts.append(streams[base:base + len(r.tokens) - r.carry])
        toks += r.tokens
    a = model.args
    X_in = torch.cat(X_parts) if X_parts else torch.zeros(0, a.hc_mult, a.hidden_size, dtype=model.residual_dtype,
                                                            device=dev)
    tok = torch.tensor(toks, dtype=torch.long, device=dev)
    offs = [0]
    for r in rows:
        offs.append(offs[-1] + len(r.tokens))
    short = [i for i, r in enumerate(rows) if len(r.tokens) <= decoder.span]
    long = [i for i, r in enumerate(rows) if len(r.tokens) > decoder.span]
    run_short, run_long = parts if parts is not None else (bool(short), bool(long))
    X = torch.empty_like(X_in)
    hid = torch.empty(X_in.shape[0], a.hidden_size, dtype=model.dtype, device=dev)
    for sel, run in ((long, run_long), (short, run_short)):
        if not run:
            continue
        idx = torch.tensor([j for i in sel for j in range(offs[i], offs[i + 1])], dtype=torch.long, device=dev)
        if sel is long:
            states = [pools.mtp_state(holdings[rows[i].req_id], rows[i].q0) for i in sel]
            x, h = model.forward_mtp(X_in[idx], tok[idx], states, [len(rows[i].tokens) for i in sel])
        else:
            x, h = decoder.mtp(X_in[idx], tok[idx], [(rows[i].q0, len(rows[i].tokens),
                                                      holdings[rows[i].req_id].tables["win"]) for i in sel])
        X[idx], hid[idx] = x, h
    pick = [i for i, r in enumerate(rows) if r.want]
    last = torch.tensor([offs[i + 1] - 1 for i in pick], dtype=torch.long, device=dev)
    X, hid = X[last], hid[last]
    chain_rows = [(rows[i].q0 + len(rows[i].tokens), holdings[rows[i].req_id].tables["win"]) for i in pick]
    chain = []
    for k in range(steps):
        nxt = torch.argmax(model.logits(hid), dim=-1)                     # greedy drafts (first max)
        chain.append(nxt)
        if k + 1 == steps:
            break
        X, hid = decoder.mtp(X, nxt, [(q + k, 1, win) for q, win in chain_rows])
    # the chain stays on the device: one host copy for all steps, not one per step
    drafted = torch.stack(chain, dim=1).tolist() if chain else [[] for _ in pick]   # [len(pick), steps]
    out: list[list[int]] = [[] for _ in rows]
    for i, ids in zip(pick, drafted):
        out[i] = ids[:rows[i].want]
    return out
