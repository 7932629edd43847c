"""The sampler (vLLM semantics; parameters in ``engine.core.sampling_params``).

Penalties first (repetition over prompt + output, frequency / presence over the output), then
temperature, top-k, top-p and min-p, then an exponential-race draw. All rows are sampled together
on the logits' device; the host gets back one small tensor per step (the ids, a finite flag per
row and the logprobs asked for), never the ``[B, V]`` logits.

Batch invariance: every decision uses only row-wise ops whose per-row results do not depend on the
batch (softmax, log-softmax, cumsum, max, top-k, sort, argmax); no full-row float
``sum`` feeds one (its split across threads changes with the number of rows). The draw is an
exponential race whose noise hashes ``(position_seed(seed, position), token id)`` in int32
arithmetic: a pure function of the row, whose only input is one int32 key per row (so a captured
step can take it), the same on every device up to the ulps of ``log1p``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from engine.core.grammar import apply_token_bitmask
from engine.core.sampling_params import Sampled, SampleRow, position_seed

# token ids travel to the host in the fp32 result tensor: exact below 2^24 (DeepSeek-V4: 129,280)
MAX_VOCAB = 1 << 24
MIN_LOGPROB = -9999.0
_U_BITS = 23            # u = (h + 0.5) / 2^23: strictly inside (0, 1) and exact in fp32
_ID_HASH: dict[tuple[int, str], torch.Tensor] = {}


def _shr_xor_(h: torch.Tensor, s: int) -> torch.Tensor:
    """``h ^= h >>> s`` in place on int32 (torch's ``>>`` is arithmetic: the sign bits are masked)."""
    return h.bitwise_xor_((h >> s).bitwise_and_((1 << (32 - s)) - 1))


def _fmix32_(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser, in place, in wrapping int32 arithmetic (signed constants)."""
    _shr_xor_(h, 16).mul_(-2048144789)            # 0x85ebca6b
    _shr_xor_(h, 13).mul_(-1028477387)            # 0xc2b2ae35
    return _shr_xor_(h, 16)


def _id_hash(vocab: int, device: torch.device) -> torch.Tensor:
    """``fmix32(id * 0x9e3779b9)`` for every token id ``[V]`` int32, made once per device."""
    key = (vocab, str(device))
    if key not in _ID_HASH:
        _ID_HASH[key] = _fmix32_(torch.arange(vocab, dtype=torch.int32, device=device).mul_(-1640531527))
    return _ID_HASH[key]


def exponential_noise(key: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``[S, vocab]`` fp32, every value > 0 and finite, from per-row keys ``[S]``
    int32: ``-log1p(-u)`` with u uniform on 2^23 points of (0, 1) hashed from (key, token id)."""
    h = _fmix32_(_id_hash(vocab, key.device)[None, :] ^ key[:, None])
    u = h.bitwise_and_((1 << _U_BITS) - 1).float()
    return u.add_(0.5).mul_(-2.0 ** -_U_BITS).log1p_().neg_()


def noise_key(key: int) -> int:
    """The 32-bit noise key (as a signed int32 value) of a 63-bit ``position_seed``: its top bits."""
    k = (key >> 31) & 0xFFFFFFFF
    return k - (1 << 32) if k >= 1 << 31 else k


@dataclass
class SampleBatch:
    """One step's per-row parameters: which rows do what (host lists and maxima: they shape the
    step, reading them needs no sync) and the drawn rows' settings as device tensors ``[S]``."""

    greedy: list[int]             # row indices
    drawn: list[int]
    penalised: list[int]
    logprobs: bool                # some row asked for logprobs
    top_n: int                    # the most top alternatives any row asked for
    top_k_max: int                # the widest top-k of the drawn rows (0: none uses top-k)
    top_p_any: bool
    temperature: torch.Tensor     # fp32
    top_k: torch.Tensor           # int64, 0 = off
    top_p: torch.Tensor           # fp32
    min_p: torch.Tensor           # fp32
    key: torch.Tensor             # int32 noise_key(position_seed(seed, position))


def sample_batch(rows: list[SampleRow], vocab: int, device: torch.device) -> SampleBatch:
    """Host half: the rows' parameters as tensors on ``device`` (an unseeded row draws a seed
    here: not reproducible, as in vLLM)."""
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    drawn = [i for i, r in enumerate(rows) if not r.params.greedy]
    penalised = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0
                 or ((r.params.frequency_penalty or r.params.presence_penalty) and r.output_ids)]
    ps = [rows[i].params for i in drawn]
    keys = [position_seed(p.seed if p.seed is not None else random.getrandbits(63), rows[i].position)
            for i, p in zip(drawn, ps)]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in ps]

    def t(vals, dtype):
        return torch.tensor(vals, dtype=dtype).to(device, non_blocking=True)

    return SampleBatch(
        greedy, drawn, penalised, any(r.params.logprobs is not None for r in rows),
        max((r.params.logprobs or 0) for r in rows), max(top_k, default=0), any(p.top_p < 1.0 for p in ps),
        t([p.temperature for p in ps], torch.float32), t(top_k, torch.int64),
        t([p.top_p for p in ps], torch.float32), t([p.min_p for p in ps], torch.float32),
        t([noise_key(k) for k in keys], torch.int32))


def _apply_penalties(work: torch.Tensor, rows: list[SampleRow], idx: list[int]) -> None:
    """vLLM's penalties on rows ``idx`` of ``work`` ``[B, V]``, in place: repetition over prompt +
    output (positive logits divided, negative multiplied), then frequency and presence over the
    output's token counts."""
    V = work.shape[1]
    dev, dt = work.device, work.dtype
    ps = [rows[i].params for i in idx]

    def padded(lists):                  # padded with V: scattered into a spare column, then cut
        n = max(1, max(len(x) for x in lists))
        return torch.tensor([x + [V] * (n - len(x)) for x in lists], dtype=torch.long).to(dev)

    def col(vals):
        return torch.tensor(vals, dtype=dt).to(dev)[:, None]

    sub = work[idx]
    rp = col([p.repetition_penalty for p in ps])
    seen = torch.zeros(len(idx), V + 1, dtype=torch.bool, device=dev)
    seen.scatter_(1, padded([rows[i].prompt_ids + rows[i].output_ids for i in idx]), True)
    sub = torch.where(seen[:, :V] & (rp != 1.0), torch.where(sub > 0, sub / rp, sub * rp), sub)
    out_ids = padded([rows[i].output_ids for i in idx])
    counts = torch.zeros(len(idx), V + 1, dtype=dt, device=dev)
    counts = counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=dt))[:, :V]
    fp, pp = col([p.frequency_penalty for p in ps]), col([p.presence_penalty for p in ps])
    work[idx] = sub - fp * counts - pp * (counts > 0).to(dt)


def _draw(work: torch.Tensor, sb: SampleBatch) -> torch.Tensor:
    """Tokens ``[S]`` int64 for the drawn rows' logits ``work`` ``[S, V]``: temperature, then the
    top-k / top-p / min-p masks (not renormalised: the race's argmax does not depend on the
    scale), then the exponential race ``argmax(probs / Exp(1) noise)``, which picks token v with
    probability ``probs[v] / sum``. A race is decided by the leading candidates alone, so a
    logit that moves by an ulp (a captured step, another device) flips a draw only at a near-tie;
    an inverse-CDF draw would move with every logit below the sample."""
    probs = torch.softmax(work / sb.temperature[:, None], dim=-1)
    zero = torch.zeros_like(probs)
    if sb.top_k_max:                    # each row's kth largest probability, from one top-k
        top = probs.topk(sb.top_k_max, dim=-1).values
        kth = top.gather(1, (torch.clamp(sb.top_k, min=1) - 1)[:, None])
        probs = torch.where((probs >= kth) | (sb.top_k[:, None] == 0), probs, zero)
    if sb.top_p_any:
        sp, order = probs.sort(dim=-1, descending=True, stable=True)
        cum = sp.cumsum(dim=-1)
        # keep tokens until the kept mass reaches top_p of the row's total: the last cumsum entry,
        # which (unlike a parallel sum) comes out the same for any batch
        keep = (cum - sp) < sb.top_p[:, None] * cum[:, -1:]
        keep[:, 0] = True               # the most likely token always (vLLM's): a top_p that
        # underflows against the total in fp32 (below ~1e-38) would otherwise mask every token
        probs = torch.where(torch.zeros_like(keep).scatter(1, order, keep), probs, zero)
    probs = torch.where(probs >= sb.min_p[:, None] * probs.max(dim=-1, keepdim=True).values, probs, zero)
    return probs.div_(exponential_noise(sb.key, probs.shape[-1])).argmax(dim=-1)


def sample_device(logits: torch.Tensor, rows: list[SampleRow],
                  mask: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
    """Device half: pick one token per row without leaving the logits' device.

    Args:
        logits: ``[B, V]`` fp32 model logits (not modified), V < 2^24.
        rows: B sequences' params, positions and histories.
        mask: the constrained rows' token bitmask (``engine.core.grammar.token_bitmask``): their
            other tokens get -inf before anything else, so the draw and the logprobs are those of
            the masked logits (vLLM's order); the finite flag still checks the model's logits.
    Returns:
        ``[B, 3 + 2 * top_n]`` fp32 on the logits' device (top_n: the most alternatives a row asked
        for, at most V): per row the token id, its raw logprob (NaN when the row asked for none), top_n
        alternative ids, their logprobs, and 1.0 where every logit of the row is finite.
    Raises:
        ValueError: V is 2^24 or more (ids would not be exact in fp32).
    """
    B, V = logits.shape
    if V >= MAX_VOCAB:
        raise ValueError(f"vocab {V} >= 2^24: token ids are not exact in the fp32 result")
    logits = logits.detach().float()
    # a NaN / inf logit makes the row sum non-finite (so would a sum past 3e38, which only a
    # broken model gives); 50x cheaper than isfinite().all() on the CPU
    finite = torch.isfinite(logits.sum(dim=-1, keepdim=True)).float()
    if mask is not None:
        logits = logits.clone()
        apply_token_bitmask(logits, mask)
    sb = sample_batch(rows, V, logits.device)
    work = logits
    if sb.penalised:
        work = logits.clone()
        _apply_penalties(work, rows, sb.penalised)
    if sb.drawn and not sb.greedy:
        tok = _draw(work, sb)
    else:
        tok = work.argmax(dim=-1)                           # first maximum: lowest id on ties
        if sb.drawn:
            drawn = torch.tensor(sb.drawn, dtype=torch.long).to(logits.device)
            tok = tok.index_copy(0, drawn, _draw(work[drawn], sb))
    cols = [tok.float()[:, None]]
    lp = torch.log_softmax(logits, dim=-1) if sb.logprobs else None
    cols.append(lp.gather(1, tok[:, None]) if lp is not None else torch.full_like(cols[0], float("nan")))
    top_n = min(sb.top_n, V)            # a vocab smaller than the alternatives asked for: all of it
    if top_n:
        # the top_n by logprob, ties by token id (top-k alone may pick any of the entries tied at
        # the cut): all above the cut value, then the lowest ids at it; sorted by id, then stably
        # by value
        cut = lp.topk(top_n, dim=-1).values[:, -1:]
        neg_id = -torch.arange(V, dtype=lp.dtype, device=lp.device).expand_as(lp)
        rank = torch.where(lp > cut, float(V), torch.where(lp == cut, neg_id, float("-inf")))
        ids = rank.topk(top_n, dim=-1).indices.sort(dim=-1).values
        vals, order = lp.gather(1, ids).sort(dim=-1, descending=True, stable=True)
        cols += [ids.gather(1, order).float(), vals]
    cols.append(finite)
    return torch.cat(cols, dim=1)


def unpack(result: list[list[float]], rows: list[SampleRow]) -> tuple[list[Sampled], list[bool]]:
    """Host side of ``sample_device``'s result (``.tolist()``, the step's one copy to the host):
    the B ``Sampled`` and whether each row's logits were finite."""
    out, finite = [], []
    for r, v in zip(rows, result):
        res, n = Sampled(int(v[0])), r.params.logprobs
        if n is not None:
            # -inf (a token a grammar masks) is reported as -9999, as vLLM does: JSON has no -inf
            res.logprob = max(v[1], MIN_LOGPROB)
            top = (len(v) - 3) // 2
            res.top_logprobs = [(int(v[2 + j]), max(v[2 + top + j], MIN_LOGPROB)) for j in range(min(n, top))]
        out.append(res)
        finite.append(v[-1] == 1.0)
    return out, finite


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[Sampled]:
    """``sample_device`` then ``unpack``: B ``Sampled`` (logprobs are the model's raw log-softmax,
    before penalties and temperature, as vLLM reports them by default; top alternatives sorted by
    logprob, ties by token id)."""
    return unpack(sample_device(logits, rows).tolist(), rows)[0]
