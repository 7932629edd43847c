"""The engine step's contract: what the scheduler asks of the model runner and what comes back.

One step of ``LLMEngine`` (vLLM v1's ``SchedulerOutput`` / ``ModelRunnerOutput``, nano-vllm's
``schedule`` / ``run``)::

    plan = scheduler.schedule()           # StepPlan: plain ids and ints, no tensors
    result = runner.execute(plan)         # StepResult: the sampled rows
    drafts = engine.update(plan, result)  # tokens appended, requests finished: the engine only
    runner.draft(drafts)                  # MTP: rollback of rejected drafts, the next drafts

Everything here is torch-free and, but for the leader-only fields (``ScheduledRow.sampling``,
``StepPlan.grammar``), msgpack-able (``to_wire`` / ``from_wire``): a multi-rank leader sends the
plan once per step and every rank runs the same ``execute`` (``engine.parallel.leader``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from engine.core.sampling_params import Sampled, SampleRow


class PoolOp(NamedTuple):
    """A change of the state-pool tensors the accounting decided (``BlockManager`` records them;
    the runner applies them in order before its next forward, on every rank that holds the
    pools: ``rank`` None, or that attention-DP rank).

    kind / args:
        "reset" (slot,): a new request's compressor state slot cleared (§3.4: CSA's previous
            window at -inf).
        "copy" (src slot, src tables, dst slot, dst tables, num_tokens): one holding's state
            after num_tokens tokens copied into another's (prefix cache: an entry made or hit).
        "carry_save" (key, req_id, num_tokens): MTP: keep the last step's trunk streams row of
            req_id at position num_tokens - 1 as prefix entry ``key``'s carry.
        "carry_bind" (key, req_id): MTP: req_id starts from entry ``key``; its first draft
            step takes the entry's carry.
        "carry_drop" (key,): entry ``key`` is gone.
        "free" (req_id,): req_id holds nothing any more (the runner forgets what it keeps of it).
    """

    kind: str
    rank: int | None
    args: tuple


@dataclass
class ScheduledRow:
    """One request's part of a step: ``token_ids`` at positions ``start ..`` (the pending tokens,
    then ``num_drafts`` MTP drafts to verify), over the state slot and block tables it holds
    (pool -> block ids, what the accounting gave it) on attention-DP rank ``rank``.

    ``samples``: its pending tokens all run, so its last ``1 + num_drafts`` positions sample;
    ``sampling``: those rows' parameters and histories (the leader's runner samples; not on the
    wire).
    """

    req_id: str
    start: int
    token_ids: list[int]
    num_drafts: int = 0
    samples: bool = False
    state_slot: int = 0
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    rank: int = 0
    sampling: list[SampleRow] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        """Position after the row's last token."""
        return self.start + len(self.token_ids)

    def to_wire(self) -> list:
        return [self.req_id, self.start, list(self.token_ids), self.num_drafts, self.samples, self.state_slot,
                {p: list(b) for p, b in self.block_tables.items()}, self.rank]

    @classmethod
    def from_wire(cls, v: list) -> "ScheduledRow":
        """Raises ValueError naming the field that is not what ``to_wire`` writes."""
        if not isinstance(v, (list, tuple)) or len(v) != 8:
            raise ValueError(f"plan row: {type(v).__name__} of {len(v) if hasattr(v, '__len__') else '?'} "
                             "fields, expected a list of 8")
        req_id, start, tokens, num_drafts, samples, slot, tables, rank = v
        if not isinstance(req_id, str):
            raise ValueError(f"plan row req_id: {req_id!r} is not a string")
        for name, x in (("start", start), ("state_slot", slot), ("rank", rank), ("num_drafts", num_drafts)):
            _check_count(f"plan row {req_id!r} {name}", x)
        _check_ids(f"plan row {req_id!r} token_ids", tokens)
        if not tokens or num_drafts >= len(tokens):
            raise ValueError(f"plan row {req_id!r}: {num_drafts} drafts in {len(tokens)} tokens")
        if not isinstance(samples, bool):
            raise ValueError(f"plan row {req_id!r} samples: {samples!r} is not a bool")
        if not isinstance(tables, dict) or not all(isinstance(k, str) for k in tables):
            raise ValueError(f"plan row {req_id!r} block_tables: not a dict of pool -> block ids")
        for pool, ids in tables.items():
            _check_ids(f"plan row {req_id!r} block_tables[{pool!r}]", ids)
        return cls(req_id, start, tokens, num_drafts, samples, slot, tables, rank=rank)


def _check_count(name: str, x) -> None:
    if type(x) is not int or x < 0:
        raise ValueError(f"{name}: {x!r} is not an int >= 0")


def _check_ids(name: str, ids) -> None:
    """A list of ints >= 0 (token ids, block ids); one pass of C-level calls, not a Python loop."""
    if not isinstance(ids, list) or (ids and (not set(map(type, ids)) <= {int} or min(ids) < 0)):
        raise ValueError(f"{name}: not a list of ints >= 0")


@dataclass
class StepPlan:
    """One step: the rows to run (decodes first, then prefill chunks, in the scheduler's order),
    the pool changes to apply before them, who was preempted (re-queued), and the leader-only
    ``grammar`` (the constrained rows' token bitmask, ``engine.core.grammar.token_bitmask``).
    ``eager``: every row runs through ``Transformer.forward_batch`` (the leader's step has a
    layer hook; every rank must run the same forwards)."""

    rows: list[ScheduledRow] = field(default_factory=list)
    pool_ops: list[PoolOp] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    grammar: object = None
    eager: bool = False

    def __bool__(self) -> bool:
        return bool(self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    def to_wire(self) -> dict:
        """The plan as msgpack-able plain types, without the leader-only fields."""
        return {"rows": [r.to_wire() for r in self.rows], "ops": [list(op) for op in self.pool_ops],
                "eager": self.eager}

    @classmethod
    def from_wire(cls, d: dict) -> "StepPlan":
        """Raises ValueError naming the field that is not what ``to_wire`` writes."""
        if not isinstance(d, dict) or set(d) != {"rows", "ops", "eager"}:
            raise ValueError(f"plan: expected a dict of rows, ops, eager; got {sorted(d) if isinstance(d, dict) else d!r}")
        if not isinstance(d["rows"], list) or not isinstance(d["eager"], bool):
            raise ValueError("plan: rows must be a list and eager a bool")
        return cls([ScheduledRow.from_wire(r) for r in d["rows"]], wire_ops(d["ops"]), eager=d["eager"])


POOL_OP_ARITY = {"reset": 1, "copy": 5, "carry_save": 3, "carry_bind": 2, "carry_drop": 1, "free": 1}


def wire_ops(ops: list) -> list[PoolOp]:
    """``PoolOp`` s from their msgpack form (args as lists; tables' keys as strings).
    Raises ValueError: an op of another kind, arity or rank type."""
    if not isinstance(ops, list):
        raise ValueError(f"pool ops: {type(ops).__name__}, expected a list")
    out = []
    for op in ops:
        if not isinstance(op, (list, tuple)) or len(op) != 3:
            raise ValueError(f"pool op {op!r}: expected [kind, rank, args]")
        k, r, a = op
        if k not in POOL_OP_ARITY or not isinstance(a, (list, tuple)) or len(a) != POOL_OP_ARITY[k]:
            raise ValueError(f"pool op {op!r}: not one of {sorted(POOL_OP_ARITY)} with its arguments")
        if r is not None:
            _check_count(f"pool op {k} rank", r)
        out.append(PoolOp(k, r, tuple(a)))
    return out


@dataclass
class RowResult:
    """A sampled row's outcome: ``1 + num_drafts`` samples (the pending position's, then each
    draft's), how many drafts they accept (the longest prefix equal to the samples), and whether
    its logits were finite (False: the engine aborts the request)."""

    req_id: str
    sampled: list[Sampled]
    accepted: int = 0
    finite: bool = True


@dataclass
class StepResult:
    """What ``execute`` returns: the sampled rows in plan order; ``failed`` names the part that
    raised ("forward": every row's state is half-advanced, "sample": the sampled rows' are past
    what they sampled), whose requests the engine aborts, with the exception in ``error``;
    ``sample_s`` the host seconds of sampling."""

    rows: list[RowResult] = field(default_factory=list)
    failed: str | None = None
    error: object = None
    sample_s: float = 0.0


class DraftRow(NamedTuple):
    """One request's part of an MTP draft step (``SpecDecoder.plan`` -> ``runner.draft``).

    ``row0``: its first catch-up row within its rows of the last step; ``q0``: that row's
    position; ``tokens``: each catch-up row's next token (``len`` rows); ``want``: drafts to make
    after the catch-up (0: catch-up only). ``carry``: the row of ``q0`` is instead the carry of
    the prefix entry the request started from (``PoolOp`` "carry_bind"; its last step did not
    compute that position), and ``row0`` is the row of ``q0 + 1``."""

    req_id: str
    row0: int
    q0: int
    tokens: list[int]
    want: int
    carry: bool = False


@dataclass
class DraftPlan:
    """The MTP part after a step: ``settle`` (req_id, tokens kept of its verify span) for every
    request still holding state that verified drafts (its rejected tail is rolled back), then
    the catch-up / draft ``rows`` chained ``steps`` times. Returns each row's drafts."""

    settle: list[tuple[str, int]] = field(default_factory=list)
    rows: list[DraftRow] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return max((r.want for r in self.rows), default=0)

    def to_wire(self) -> dict:
        return {"settle": [list(s) for s in self.settle], "rows": [list(r) for r in self.rows]}

    @classmethod
    def from_wire(cls, d: dict) -> "DraftPlan":
        """Raises ValueError naming the field that is not what ``to_wire`` writes."""
        if not isinstance(d, dict) or not isinstance(d.get("settle"), list) or not isinstance(d.get("rows"), list):
            raise ValueError("draft plan: expected a dict of settle and rows lists")
        settle = []
        for v in d["settle"]:
            if not isinstance(v, (list, tuple)) or len(v) != 2 or not isinstance(v[0], str):
                raise ValueError(f"draft plan settle {v!r}: expected [req_id, tokens kept]")
            _check_count(f"draft plan settle {v[0]!r}", v[1])
            settle.append(tuple(v))
        rows = []
        for v in d["rows"]:
            if not isinstance(v, (list, tuple)) or len(v) not in (5, 6) or not isinstance(v[0], str):
                raise ValueError(f"draft plan row {v!r}: expected [req_id, row0, q0, tokens, want(, carry)]")
            for name, x in zip(("row0", "q0", "want"), (v[1], v[2], v[4])):
                _check_count(f"draft plan row {v[0]!r} {name}", x)
            _check_ids(f"draft plan row {v[0]!r} tokens", v[3])
            if len(v) == 6 and not isinstance(v[5], bool):
                raise ValueError(f"draft plan row {v[0]!r} carry: {v[5]!r} is not a bool")
            rows.append(DraftRow(*v))
        return cls(settle, rows)
