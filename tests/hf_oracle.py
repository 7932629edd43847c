"""Test helpers: the HF transformers oracle, and how top-k ties are kept from deciding parity.

HF and our reference compute indexer and router scores in a different op order (relative
differences ~1e-7..1e-6). Where the k-th and (k+1)-th scores of a row are that close, the two may
legitimately pick differently, and everything downstream then differs. So:
  * ``TieGuard`` (an ops override) records our picks and each row's relative top-k margin;
  * ``HFPicks`` (forward hooks) records HF's picks;
  * if every pick agrees, logits are compared with the plain HF forward;
  * otherwise HF is run again with ``force`` set: on each row where its pick differs from ours the
    hook asserts our margin is a near-tie (< ``TIE_REL``), else the test fails, and substitutes our
    pick (router weights recomputed from HF's own logits). Logits are then compared at every
    position, strictly.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.nn.functional as F

import engine.ops.reference as R
from engine.config import CSA_RATIO
from engine.ops import REFERENCE
from engine.ops.cache_codec import quant_query
from engine.ops.reference.cache import closed_entries

TIE_REL = 1e-5


def load_hf(ckpt):
    """HF transformers 5.23.0 DeepseekV4ForCausalLM on the SAME directory, fp32 (FP8 dequantised)."""
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    model = DeepseekV4ForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32,
                                                  quantization_config=FineGrainedFP8Config(dequantize=True))
    return model.float().eval()          # its FP8 loader leaves the bf16-stored tensors in bf16


class TieGuard:
    """Ops wrapper: same results as the reference ops, plus a record of every top-k pick.

    ``index[(slot, pos)]`` / ``route[(slot, pos)]`` -> (picked ids as a frozenset, margin), where slot
    counts CSA layers (indexer) or score-routed layers (router) in layer order.
    """

    def __init__(self, args):
        self.n_csa = sum(r == CSA_RATIO for r in args.compress_ratios[: args.num_hidden_layers])
        self.n_routed = args.num_hidden_layers - args.num_hash_layers
        self.ops = REFERENCE.with_overrides(indexer_topk=self.indexer_topk, cache_indexer_topk=self.cache_indexer_topk,
                                            gating_topk=self.gating_topk)
        self.reset()

    def reset(self):
        self.index, self.route = {}, {}
        self._calls = defaultdict(int)

    def indexer_topk(self, q, weights, keys, positions, ratio, topk, scale):
        slot = self._calls["index"] % self.n_csa
        self._calls["index"] += 1
        out = torch.full((q.shape[0], topk), -1, dtype=torch.long)
        for t0, t1, s, allowed in R.indexer_scores(q, weights, keys, positions, ratio, scale):
            out[t0:t1] = R.topk_low_index(s, allowed, topk)
            self._record(self.index, slot, positions[t0:t1], out[t0:t1], s, allowed.sum(-1), topk)
        return out

    def cache_indexer_topk(self, q, weights, keys, block_table, block_size, positions, ratio, topk, scale):
        """``reference.cache_indexer_topk`` through the guarded ``indexer_topk``."""
        k = closed_entries(keys, block_table, block_size, positions, ratio)
        return self.indexer_topk(quant_query(keys.codec, q), weights, k, positions, ratio, topk, scale)

    def gating_topk(self, logits, bias, hash_ids, k, routed_scaling):
        w, ids = R.gating_topk(logits, bias, hash_ids, k, routed_scaling)
        if hash_ids is None:
            slot = self._calls["route"] % self.n_routed
            self._calls["route"] += 1
            s = F.softplus(logits.float()).sqrt() + bias
            n = torch.full((s.shape[0],), s.shape[1])
            self._record(self.route, slot, self._route_pos, ids, s, n, k)
        return w, ids

    def _record(self, table, slot, positions, picks, scores, n_cand, k):
        top = scores.topk(min(k + 1, scores.shape[1]), dim=-1).values
        for i, p in enumerate(positions.tolist()):
            margin = math.inf
            if n_cand[i] > k:
                margin = (top[i, k - 1] - top[i, k]).item() / max(1.0, abs(top[i, k - 1].item()))
            table[(slot, p)] = (frozenset(x for x in picks[i].tolist() if x >= 0), margin)

    def set_positions(self, positions: torch.Tensor):
        """Router calls do not see positions; the test sets the current forward's positions."""
        self._route_pos = positions


class HFPicks:
    """Forward hooks on HF's indexers and score routers: their picks, optionally overridden.

    ``natural[kind][slot]`` = HF's own picks ``[S, k]`` (row = position) of the last forward;
    ``substituted`` counts rows where a forced near-tie decision replaced HF's.
    """

    def __init__(self, hf):
        self.natural = {"index": {}, "route": {}}
        self.force: TieGuard | None = None
        self.substituted = 0
        layers = hf.model.layers
        csa = [l for l in layers if hasattr(l.self_attn.compressor, "indexer")]
        for slot, layer in enumerate(csa):
            layer.self_attn.compressor.indexer.register_forward_hook(self._hook("index", slot))
        for slot, layer in enumerate(l for l in layers if not l.mlp.is_hash):
            layer.mlp.gate.register_forward_hook(self._hook("route", slot))

    def _hook(self, kind, slot):
        def f(module, inputs, output):
            ids = output if kind == "index" else output[2]
            rows = ids.reshape(-1, ids.shape[-1])
            self.natural[kind][slot] = rows.clone()
            if self.force is None:
                return None
            ours = getattr(self.force, kind)
            new = rows.clone()
            for p in range(rows.shape[0]):
                picked, margin = ours.get((slot, p), (frozenset(), math.inf))    # no candidates yet
                if frozenset(x for x in rows[p].tolist() if x >= 0) != picked:
                    assert margin < TIE_REL, f"{kind} slot {slot} position {p}: picks differ, margin {margin:.2e}"
                    new[p] = torch.tensor(sorted(picked) + [-1] * (rows.shape[1] - len(picked)))
                    self.substituted += 1
            if kind == "index":
                return new.view_as(output)
            logits = output[0]
            s = F.softplus(logits.float()).sqrt().gather(1, new)
            w = s / (s.sum(-1, keepdim=True) + 1e-20) * module.routed_scaling_factor
            return logits, w.to(output[1].dtype), new
        return f


def picks_agree(guard: TieGuard, hf: HFPicks) -> bool:
    """True when every pick we recorded equals HF's from its last natural forward."""
    for kind in ("index", "route"):
        for (slot, p), (picked, _) in getattr(guard, kind).items():
            if frozenset(x for x in hf.natural[kind][slot][p].tolist() if x >= 0) != picked:
                return False
    return True


@torch.no_grad()
def hf_logits_forced(hf, picks: HFPicks, guard: TieGuard, ids: torch.Tensor) -> torch.Tensor:
    """HF forward over ``ids`` taking our decision on every near-tie row where the picks differ."""
    picks.force = guard
    try:
        return hf_logits(hf, ids)
    finally:
        picks.force = None


@torch.no_grad()
def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    """Full no-cache forward: ``[T]`` ids -> ``[T, V]`` fp32 logits."""
    return hf(input_ids=ids[None], use_cache=False).logits[0].float()
