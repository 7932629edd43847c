"""DeepSeek-V4 network: decoder block with mHC, the trunk, the MTP block (§3.1, §3.2, §3.8).

Parameter names equal the original checkpoint's tensor names (reference §2.2), so loading is a
name lookup. Letters: T tokens, n mHC streams, H hidden, V vocab.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelArgs
from engine.model.attention import Attention
from engine.model.layers import Linear, RMSNorm, RotaryTable, param
from engine.model.moe import MoE
from engine.ops import REFERENCE, Ops
from engine.model.state import LayerState, SequenceState


class Block(nn.Module):
    """One decoder layer: mHC around attention and around MoE (§3.2)."""

    def __init__(self, args: ModelArgs, ratio: int, hash_layer: bool, rope: RotaryTable, dtype: torch.dtype,
                 ops: Ops):
        super().__init__()
        H, n = args.hidden_size, args.hc_mult
        mix = (2 + n) * n
        self.args, self.ops, self.dtype = args, ops, dtype
        self.attn_norm = RMSNorm(H, args.rms_norm_eps, ops)
        self.attn = Attention(args, ratio, rope, dtype, ops)
        self.ffn_norm = RMSNorm(H, args.rms_norm_eps, ops)
        self.ffn = MoE(args, hash_layer, dtype, ops)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", param((mix, n * H), torch.float32))
            setattr(self, f"hc_{site}_base", param((mix,), torch.float32))
            setattr(self, f"hc_{site}_scale", param((3,), torch.float32))

    def _hc_pre(self, X: torch.Tensor, site: str):
        a = self.args
        return self.ops.hc_pre(X, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_scale"),
                               getattr(self, f"hc_{site}_base"), a.rms_norm_eps, a.hc_eps, a.hc_sinkhorn_iters)

    def forward(self, X: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                spans: list[tuple[int, int, int]], states: list[LayerState], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """X ``[T, n, H]`` residual streams -> ``[T, n, H]`` in X's dtype (fp32, or bf16 where the
        platform's mHC kernels take it: ``engine.ops.residual_dtype_for``); blocks compute in ``self.dtype``.

        Rows are packed tokens of several sequences (see ``Attention.forward`` for spans / states).
        """
        y, post, comb = self._hc_pre(X, "attn")
        a = self.attn(self.attn_norm(y).to(self.dtype), positions, spans, states, cos, sin)
        X = self.ops.hc_post(a, X, post, comb)
        y, post, comb = self._hc_pre(X, "ffn")
        m = self.ffn(self.ffn_norm(y).to(self.dtype), tokens)
        return self.ops.hc_post(m, X, post, comb)


def _add_hc_head(module: nn.Module, args: ModelArgs) -> None:
    n = args.hc_mult
    module.hc_head_fn = param((n, n * args.hidden_size), torch.float32)
    module.hc_head_base = param((n,), torch.float32)
    module.hc_head_scale = param((1,), torch.float32)


class MTPBlock(Block):
    """Multi-token prediction layer (§3.8): one window-only block drafting the token after next.

    Checked against DeepSeek's own V4 ``inference/model.py`` (``MTPBlock.forward``, several public
    copies agree) and vLLM's ``deepseek_v4_mtp.py``: the input is the trunk's last Block output
    *streams* ``[T, n, H]`` (before the main hc_head and final norm), normed per stream by
    ``hnorm``; ``e_proj(enorm(embed(t+1)))`` is broadcast over the streams and added to
    ``h_proj`` of each stream; then one Block (ratio 0: window only, main RoPE, MoE with bias) at
    the positions of the input hidden states, and the shared head after this block's own hc_head
    and ``norm``. DeepSeek's code has no draft loop; for chained drafts (next_n > 1) this block's
    own output streams are the next draft's input, as vLLM's DeepSeek-V4 MTP proposer chains it.
    """

    def __init__(self, args: ModelArgs, rope: RotaryTable, dtype: torch.dtype, ops: Ops):
        super().__init__(args, 0, False, rope, dtype, ops)
        H = args.hidden_size
        self.enorm = RMSNorm(H, args.rms_norm_eps, ops)
        self.hnorm = RMSNorm(H, args.rms_norm_eps, ops)
        self.norm = RMSNorm(H, args.rms_norm_eps, ops)
        self.e_proj = Linear(H, H, dtype, ops)
        self.h_proj = Linear(H, H, dtype, ops)
        _add_hc_head(self, args)

    def forward_mtp(self, streams: torch.Tensor, emb_next: torch.Tensor, tokens_next: torch.Tensor,
                    positions: torch.Tensor, spans: list[tuple[int, int, int]], states: list[LayerState],
                    cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed rows of several sequences (``spans`` / ``states`` as ``Block.forward``; ``states``
        their MTP window states, updated in place).

        Args:
            streams: ``[T, n, H]`` residual dtype: row t's trunk output streams (or this block's, chaining).
            emb_next: ``[T, H]`` compute dtype, the embedding of row t's next token ``tokens_next``.
            positions: ``[T]`` int64, the positions of the input hidden states.
        Returns:
            (``[T, n, H]`` output streams in ``streams``' dtype, ``[T, H]`` compute-dtype hidden for
            the shared head).
        """
        X = self.forward(self.mtp_input(streams, emb_next), tokens_next, positions, spans, states, cos, sin)
        return X, self.mtp_output(X)

    def mtp_input(self, streams: torch.Tensor, emb_next: torch.Tensor) -> torch.Tensor:
        """The block's input streams ``[T, n, H]`` (``streams``' dtype): ``e_proj(enorm(emb_next))``
        broadcast over the streams plus ``h_proj(hnorm(streams))`` per stream."""
        T, n, H = streams.shape
        e = self.e_proj(self.enorm(emb_next))                                           # [T, H]
        h = self.h_proj(self.hnorm(streams.reshape(T * n, H)).to(self.dtype)).view(T, n, H)
        return (e.unsqueeze(1) + h).to(streams.dtype)                  # the trunk's residual dtype

    def mtp_output(self, X: torch.Tensor) -> torch.Tensor:
        """The block's output streams ``[T, n, H]`` -> hidden ``[T, H]`` (compute dtype) for the
        shared head: its own hc_head and ``norm``."""
        a = self.args
        hid = self.ops.hc_head(X, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, a.rms_norm_eps, a.hc_eps)
        return self.norm(hid).to(self.dtype)


class Transformer(nn.Module):
    """The DeepSeek-V4 trunk + LM head (+ MTP blocks). Built empty; ``engine.checkpoint.loader`` fills it.

    Args:
        args: checkpoint config. dtype: compute dtype (fp32 or bf16). Weights are kept as the
            checkpoint stores them (``engine.checkpoint.loader``); the math of norms, mHC (residual
            streams included), sinks, router, compressor and LM head runs in fp32 (§5).
        ops: the op table (seam).
    """

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32, ops: Ops = REFERENCE):
        super().__init__()
        self.args, self.dtype, self.ops = args, dtype, ops
        r = args.qk_rope_head_dim
        self.rope_main = RotaryTable(r, args.rope_theta)
        self.rope_compress = RotaryTable(r, args.compress_rope_theta, args.rope_scaling)
        self.embed = nn.Module()
        self.embed.weight = param((args.vocab_size, args.hidden_size), dtype)
        self.layers = nn.ModuleList(
            Block(args, args.compress_ratios[i], args.is_hash_layer(i), self._rope(args.compress_ratios[i]), dtype, ops)
            for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        # fp32 head: bf16-rounded logits flip the greedy argmax on a few % of steps
        self.head = Linear(args.hidden_size, args.vocab_size, torch.float32, ops)
        _add_hc_head(self, args)
        self.mtp = nn.ModuleList(MTPBlock(args, self.rope_main, dtype, ops) for _ in range(args.num_mtp_layers))
        self.residual_dtype = torch.float32          # configure() sets the platform's

    def residual_streams(self, emb: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[T, H]`` -> the ``hc_mult`` identical residual streams ``[T, n, H]`` in
        ``residual_dtype`` (fp32 unless the platform's mHC kernels take bf16; §3.1 step 2, §5 row 6)."""
        return emb.to(self.residual_dtype).unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()

    def configure(self, moe_chunk_max_len: int | None = None, platform=None, multi_streams: bool = False,
                  residual_dtype: torch.dtype = torch.float32) -> None:
        """Run options: routed-MoE chunk length (custom_params.moe_chunk_max_len), with
        ``multi_streams`` on a device platform the shared expert on a side stream (§8.2), and the
        mHC residual streams' dtype (``engine.ops.residual_dtype_for``)."""
        self.residual_dtype = residual_dtype
        side = platform.new_stream() if multi_streams and platform is not None else None
        for layer in [*self.layers, *self.mtp]:
            layer.ffn.chunk, layer.ffn.platform, layer.ffn.side = moe_chunk_max_len, platform, side

    def _rope(self, ratio: int) -> RotaryTable:
        """Window-only layers use the main rope; CSA / HCA the YaRN compress rope (§3.3 step 3)."""
        return self.rope_compress if ratio else self.rope_main

    def new_state(self, with_mtp: bool = False, cache=None) -> SequenceState:
        """Empty per-request decode state matching this model; ``cache``: the caches' storage
        (``engine.cache_dtype.CacheDtype``; None: unquantised)."""
        return SequenceState.new(self.args, self.dtype, self.embed.weight.device, with_mtp, cache)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, state: SequenceState) -> torch.Tensor:
        """Run ``tokens`` (the next ``T`` tokens of one sequence) and advance ``state``.

        Args:
            tokens: ``[T]`` int64 token ids at positions ``state.num_tokens ..``.
            state: the sequence's decode state (``new_state`` or a paged one); updated in place.
        Returns:
            ``[T, H]`` final hidden states (after hc_head and the final norm), compute dtype.
        Raises:
            ValueError: as ``forward_batch``.
        """
        return self.forward_batch(tokens, [state], [tokens.shape[0]])

    @torch.no_grad()
    def forward_batch(self, tokens: torch.Tensor, states: list, lengths: list[int],
                      layer_hook: Callable[[int], None] | None = None, streams: bool = False):
        """Run a batch of sequences packed into one token row (chunked prefill and decode mixed).

        Sequence i contributes ``lengths[i]`` consecutive tokens at positions
        ``states[i].num_tokens ..``; each ``states[i]`` (``SequenceState`` or ``PagedSequenceState``)
        advances by its length. A row's result does not depend on the other sequences in the batch.

        Args:
            tokens: ``[sum(lengths)]`` int64. states: one per sequence. lengths: tokens per sequence.
            layer_hook: called with ``i`` after layer ``i`` ran (its state is final for this step).
            streams: also return the last Block's output streams (the MTP layer's input).
        Returns:
            ``[sum(lengths), H]`` final hidden states, compute dtype (with ``streams``: and
            ``[sum(lengths), n, H]`` fp32 streams before hc_head). No sequences (``tokens`` ``[0]``)
            runs every layer on zero rows: an idle attention-DP rank still joins the collectives.
        Raises:
            ValueError: an empty sequence, a sequence longer than ``max_position_embeddings``, or a
                state built for another model. A failure mid-forward leaves the states partly
                advanced: the caller drops them (the requests fail), they are never reused.
        """
        a = self.args
        if len(states) != len(lengths) or sum(lengths) != tokens.shape[0]:
            raise ValueError(f"forward: {len(states)} states, lengths {lengths} for {tokens.shape[0]} tokens")
        spans, pos, off = [], [], 0
        for st, n in zip(states, lengths):
            start = st.num_tokens
            if n <= 0:
                raise ValueError("forward: tokens must be non-empty")
            if start + n > a.max_position_embeddings:
                raise ValueError(f"forward: sequence length {start + n} exceeds max_position_embeddings "
                                 f"{a.max_position_embeddings}")
            if len(st.layers) != len(self.layers):
                raise ValueError(f"forward: state has {len(st.layers)} layers, the model {len(self.layers)}")
            spans.append((off, n, start))
            pos.append(torch.arange(start, start + n, device=tokens.device))
            off += n
        positions = torch.cat(pos) if pos else tokens.new_zeros(0)         # no sequences: an idle DP rank
        main, compress = self.rope_main.cos_sin(positions), self.rope_compress.cos_sin(positions)
        X = self.residual_streams(self.embed_tokens(tokens))
        for i, layer in enumerate(self.layers):
            X = layer(X, tokens, positions, spans, [st.layers[i] for st in states],
                      *(compress if layer.attn.ratio else main))
            if layer_hook is not None:
                layer_hook(i)
        for st, n in zip(states, lengths):
            st.num_tokens += n
        h = self.ops.hc_head(X, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, a.rms_norm_eps, a.hc_eps)
        h = self.norm(h).to(self.dtype)
        return (h, X) if streams else h

    @torch.no_grad()
    def forward_mtp(self, streams: torch.Tensor, tokens_next: torch.Tensor, states: list, lengths: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run MTP layer 0 over packed rows: sequence i's ``lengths[i]`` rows at positions
        ``states[i].num_tokens ..`` (its MTP window state; it advances by its length).

        Args:
            streams: ``[sum(lengths), n, H]`` fp32 input streams (``forward_batch(streams=True)``
                rows, or ``forward_mtp``'s own output when chaining drafts).
            tokens_next: ``[sum(lengths)]`` int64, each row's next token.
            states: per sequence, an MTP window ``LayerState`` with a ``num_tokens`` attribute.
        Returns:
            (output streams ``[sum(lengths), n, H]`` fp32, hidden ``[sum(lengths), H]`` for ``logits``).
        Raises:
            ValueError: the model has no MTP layer (loaded without it), or lengths / rows disagree.
        """
        if not len(self.mtp):
            raise ValueError("forward_mtp: the model was loaded without its MTP layer (next_n 0)")
        if len(states) != len(lengths) or sum(lengths) != tokens_next.shape[0]:
            raise ValueError(f"forward_mtp: {len(states)} states, lengths {lengths} for {tokens_next.shape[0]} rows")
        spans, pos, off = [], [], 0
        for st, n in zip(states, lengths):
            spans.append((off, n, st.num_tokens))
            pos.append(torch.arange(st.num_tokens, st.num_tokens + n, device=tokens_next.device))
            off += n
        positions = torch.cat(pos) if pos else tokens_next.new_zeros(0)     # no sequences: an idle DP rank
        cos, sin = self.rope_main.cos_sin(positions)
        out = self.mtp[0].forward_mtp(streams, self.embed_tokens(tokens_next), tokens_next, positions, spans,
                                      states, cos, sin)
        for st, n in zip(states, lengths):
            st.num_tokens += n
        return out

    # embedding / LM-head tensor parallelism (``engine.parallel.shard.EmbedTP`` / ``LMHeadTP``):
    # (model, x) -> what ``embed_tokens`` / ``logits`` return, from this rank's vocab slice with
    # the ranks' parts joined; None: the whole vocabulary here
    embed_tp = None
    lmhead_tp = None

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens ``[T]`` int64 -> embeddings ``[T, H]``, compute dtype (under embedding TP
        through ``embed_tp``)."""
        if self.embed_tp is not None:
            return self.embed_tp(self, tokens)
        return F.embedding(tokens, self.embed.weight).to(self.dtype)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[T, H]`` -> logits ``[T, V]`` fp32 (fp32 products of the compute-dtype hidden;
        under LM-head TP through ``lmhead_tp``)."""
        if self.lmhead_tp is not None:
            return self.lmhead_tp(self, hidden)
        h = self.head
        if h.fmt is not None:                      # a converted checkpoint keeping the head packed
            return h(hidden.float())
        return self.ops.lm_head(h.quant_input(hidden.float()), h.weight)
