"""Test helpers: the HF transformers oracle, and the tie-tolerant comparison of top-k picks.

How indexer / router top-k ties are kept from deciding a parity test: HF and our reference
compute the selection scores in a different op order (relative differences ~1e-7..1e-6), so where
the k-th and (k+1)-th scores of a row are that close the two may legitimately pick differently.
``TieGuard`` records our picks and their margins, ``HFPicks`` records HF's picks (forward hooks).
Every row where they differ must be a near-tie (relative margin < ``TIE_REL``), else the test
fails; logits are then compared strictly only at positions before the first such divergence
(the tests require that to cover nearly all positions, so a seed that ties early shows up).
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.nn.functional as F

import engine.ops.reference as R
from engine.config import CSA_RATIO
from engine.ops import REFERENCE

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
        self.ops = REFERENCE.with_overrides(indexer_topk=self.indexer_topk, gating_topk=self.gating_topk)
        self.reset()

    def reset(self):
        self.index, self.route = {}, {}
        self._calls = defaultdict(int)

    def indexer_topk(self, q, weights, keys, positions, ratio, topk, scale):
        slot = self._calls["index"] % self.n_csa
        self._calls["index"] += 1
        out = torch.full((q.shape[0], topk), -1, dtype=torch.long)
        for t0, t1, s, allowed in R.indexer_scores(q, weights, keys, positions, ratio, scale):
            out[t0:t1] = R._topk_low_index(s, allowed, topk)
            self._record(self.index, slot, positions[t0:t1], out[t0:t1], s, allowed.sum(-1), topk)
        return out

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
    """Forward hooks on HF's indexers and score routers: their picks for the last forward."""

    def __init__(self, hf):
        self.index, self.route = {}, {}
        layers = hf.model.layers
        csa = [l for l in layers if l.self_attn.compressor is not None and hasattr(l.self_attn.compressor, "indexer")]
        for slot, layer in enumerate(csa):
            layer.self_attn.compressor.indexer.register_forward_hook(self._hook(self.index, slot))
        routed = [l for l in layers if not l.mlp.is_hash]
        for slot, layer in enumerate(routed):
            layer.mlp.gate.register_forward_hook(self._hook(self.route, slot))

    def restore(self, index: dict, route: dict):
        """Put back picks saved from an earlier forward (the hooks keep writing to the same dicts)."""
        self.index.clear(), self.index.update(index)
        self.route.clear(), self.route.update(route)

    @staticmethod
    def _hook(table, slot):
        def f(module, inputs, output):
            ids = output if isinstance(output, torch.Tensor) else output[2]
            table[slot] = ids.reshape(-1, ids.shape[-1])           # [S, k], row = position
        return f


def first_divergence(guard: TieGuard, hf: HFPicks) -> int | None:
    """First position where HF and we picked differently (None if never). Fails on a non-tie."""
    first = None
    for ours, theirs in ((guard.index, hf.index), (guard.route, hf.route)):
        for (slot, p), (picked, margin) in ours.items():
            hf_picked = frozenset(x for x in theirs[slot][p].tolist() if x >= 0)
            if hf_picked != picked:
                assert margin < TIE_REL, f"slot {slot} position {p}: picks differ without a tie (margin {margin:.2e})"
                first = p if first is None else min(first, p)
    return first


@torch.no_grad()
def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    """Full no-cache forward: ``[T]`` ids -> ``[T, V]`` fp32 logits."""
    return hf(input_ids=ids[None], use_cache=False).logits[0].float()
