"""P/D: a request's state out of a prefill engine and into a decode engine (the roles' store).

States of one request id on each side (``DESIGN.md``'s request path)::

    prefill:  add_request(hold_state) --step samples token #1--> held --export / release--> gone
    decode:   reserve --> reserved --load_state (per layer)--> reserved --commit--> running (engine)
                              \\--unreserve (lease end, abort, failed transfer)--> gone

``PDState`` holds the two maps and the calls that move a request between them; the engine's
scheduler, accounting and runner do the rest (``LLMEngine.pd``). Decoding continues exactly as if
the decode engine had prefilled the request (same seed -> same tokens): ``commit`` appends token
#1 through the engine's one finish rule (``join``).
"""
from __future__ import annotations

from collections.abc import Callable

from engine.core.block_manager import BlockManager, CacheFullError
from engine.core.request import RequestError, Sequence
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerLimits


class PDState:
    """The held (prefill) and reserved (decode) requests of one engine.

    Args:
        cache: the engine's accounting; scheduler: its scheduler (batch places, running set);
        runner: its model runner (the state tensors); limits: the engine's limits;
        next_n: MTP drafts per step (0: none); vocab_size: token ids are below it.
        check_new: (request_id, prompt_ids, params, output_ids) -> None, raising RequestError
            (the engine's check of a new request). matcher: (params, output_ids) -> the
            sample's grammar matcher or None. join: (seq, first_token, draft_ids) -> None: a
            committed request joins the running batch (``LLMEngine``).
    """

    def __init__(self, cache: BlockManager, scheduler: Scheduler, runner, limits: SchedulerLimits, next_n: int,
                 vocab_size: int, check_new: Callable, matcher: Callable, join: Callable):
        self.cache, self.scheduler, self.runner, self.limits = cache, scheduler, runner, limits
        self.next_n, self.vocab_size = next_n, vocab_size
        self._check_new, self._matcher, self._join = check_new, matcher, join
        self.held: dict[str, Sequence] = {}      # prefill: finished, state kept for export
        self.reserved: dict[str, Sequence] = {}  # decode: state slots taken, state not yet loaded
        self.loaded: dict[str, set[int]] = {}    # reserved -> the trunk layers loaded so far

    def in_use(self, rid: str) -> bool:
        return rid in self.held or rid in self.reserved

    # ---- prefill role -------------------------------------------------------------------------
    def hold(self, seq: Sequence) -> None:
        """A ``hold_state`` request finished: its state stays for export until ``release``."""
        self.held[seq.seq_id] = seq

    def export_state(self, request_id: str):
        """A held request (``Sequence``) and its state tensors (``state_tensors`` at L = prompt
        length: the sampled first token is not yet in the state; with MTP the rings too).
        Raises KeyError."""
        seq = self.held[request_id]
        held = self.cache.seqs[request_id]
        return seq, {**self.runner.state_tensors(held, seq.num_computed), **self.mtp_state(request_id)}

    def mtp_state(self, request_id: str) -> dict:
        """A held request's MTP window rings (``mtp_state_tensors``; {} without MTP): final once
        the step that sampled its first token ran (its drafts: the held ``Sequence.draft_ids``)."""
        if not self.next_n:
            return {}
        return self.runner.mtp_state_tensors(self.cache.seqs[request_id], self.held[request_id].num_computed)

    def layer_state(self, request_id: str, num_tokens: int, layer: int) -> dict:
        """Layer ``layer`` of a request's state after ``num_tokens`` tokens (``state_tensors``
        names; copies, safe to send later): what the step's layer hook announces. Raises KeyError."""
        return self.runner.state_tensors(self.cache.seqs[request_id], num_tokens, [layer])

    def release(self, request_id: str) -> bool:
        """Free a held request's state. False if it holds none."""
        if self.held.pop(request_id, None) is None:
            return False
        self.cache.free(request_id)
        return True

    # ---- decode role --------------------------------------------------------------------------
    def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                output_ids: list[int] = ()) -> None:
        """Take the state slots and a batch place for a request prefilled elsewhere, before its
        prefill runs (its state then lands in place: ``load_state`` + ``commit``).

        Holds blocks for L + 1 + ``num_reserved_decode_tokens`` tokens (capped at max_model_len),
        L = prompt + ``output_ids`` (a migrated stream's tokens so far, as in ``add_request``).
        Raises:
            RequestError: a bad field (``params.seed`` must be set: prefill samples with it).
            CacheFullError: no room (state blocks, or ``batch_size`` places); nothing is held then.
        """
        self._check_new(request_id, prompt_ids, params, output_ids)
        if request_id in self.reserved:
            raise RequestError(f"request_id: {request_id!r} is already reserved")
        if params.seed is None:
            raise RequestError("sampling_params.seed: must be the seed prefill samples with")
        if len(self.scheduler.running) + len(self.reserved) >= self.limits.batch_size:
            raise CacheFullError(f"batch full: {self.limits.batch_size} requests running or reserved")
        L = len(prompt_ids) + len(output_ids)
        matcher = self._matcher(params, output_ids)
        self.cache.allocate(request_id, min(L + 1 + self.limits.num_reserved_decode_tokens, self.limits.max_model_len))
        self.reserved[request_id] = Sequence(request_id, list(prompt_ids), params, output_ids=list(output_ids),
                                             num_computed=L, matcher=matcher)
        self.scheduler.num_reserved = len(self.reserved)

    def load_state(self, request_id: str, tensors: dict, layers: list[int] | None = None) -> None:
        """Write (some layers of) a reserved request's imported state (``state_tensors`` names).

        Raises:
            KeyError: not reserved. RequestError: tensors that do not match this model (``state``);
                nothing is written then.
        """
        seq = self.reserved[request_id]
        try:
            if not isinstance(tensors, dict) or not all(isinstance(k, str) for k in tensors):
                raise ValueError(f"a {type(tensors).__name__}, expected a dict of name -> tensor")
            if not self.next_n and any(k.startswith("mtp.") for k in tensors):
                mtp = sorted(k for k in tensors if k.startswith("mtp."))
                raise ValueError(f"MTP state {mtp[:2]} for an engine without MTP (next_n 0)")
            if layers is not None and any(type(l) is not int for l in layers):
                raise ValueError(f"layers {list(layers)[:4]!r}: not layer numbers")
            self.runner.load_state(self.cache.seqs[request_id], seq.num_computed, tensors, layers,
                                   self.cache.take_ops(), self.cache.rank_of(request_id))
        except ValueError as e:
            raise RequestError(f"state: {e}") from None
        if any(not k.startswith("mtp.") for k in tensors) or not tensors:
            self.loaded.setdefault(request_id, set()).update(
                range(self.cache.geometry.num_layers) if layers is None else layers)

    def commit(self, request_id: str, first_token: int, draft_ids: list[int] = ()) -> None:
        """A reserved request whose whole state is loaded joins the running batch with token #1
        (and, with MTP, the drafts prefill made after it, its MTP rings loaded).

        Raises KeyError (not reserved), RequestError (bad token or drafts, or a trunk layer not
        loaded; the reservation is kept).
        """
        seq = self.reserved[request_id]
        V = self.vocab_size
        if type(first_token) is not int or not 0 <= first_token < V:
            raise RequestError(f"first_token: {first_token!r} is not a token id")
        if draft_ids and (not self.next_n or len(draft_ids) > self.next_n
                          or any(type(t) is not int or not 0 <= t < V for t in draft_ids)):
            raise RequestError(f"draft_ids: {list(draft_ids)[:8]!r} are not up to next_n "
                               f"{self.next_n} token ids")
        missing = sorted(set(range(self.cache.geometry.num_layers)) - self.loaded.get(request_id, set()))
        if missing:
            raise RequestError(f"state: layers {missing[:8]} of {self.cache.geometry.num_layers} not loaded")
        del self.reserved[request_id]
        self.loaded.pop(request_id, None)
        self.scheduler.num_reserved = len(self.reserved)
        self._join(seq, first_token, list(draft_ids))

    def unreserve(self, request_id: str) -> bool:
        """Drop a reservation and free its slots. False if there is none."""
        self.loaded.pop(request_id, None)
        if self.reserved.pop(request_id, None) is None:
            return False
        self.scheduler.num_reserved = len(self.reserved)
        self.cache.free(request_id)
        return True

    def add_prefilled(self, request_id: str, prompt_ids: list[int], first_token: int, params: SamplingParams,
                      tensors: dict) -> None:
        """Join a request prefilled elsewhere: its state for L = len(prompt_ids) and token #1
        (``reserve`` + ``load_state`` + ``commit`` in one call).

        Raises:
            RequestError: a bad field, or state tensors that do not match this model (``state``).
            CacheFullError: no room (state blocks or ``batch_size``); nothing is held then.
        """
        if not isinstance(first_token, int) or not 0 <= first_token < self.vocab_size:
            raise RequestError(f"first_token: {first_token!r} is not a token id")
        self.reserve(request_id, prompt_ids, params)
        try:
            self.load_state(request_id, tensors)
        except RequestError:
            self.unreserve(request_id)
            raise
        self.commit(request_id, first_token)
