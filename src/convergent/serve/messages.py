"""The typed messages between the engine, its executor and the stages (no tuples).

Engine -> a stage (its input queue): :class:`BatchMeta` per micro-batch,
:class:`RendezvousPort` (stages after the first, before anything else) and
:class:`StopStage`. Stage -> engine (the shared output queue): :class:`RendezvousPort`
(stage 0's store), :class:`StageReady`, :class:`Heartbeat`, :class:`StageBusy` (a stage
but the last finished a micro-batch), :class:`BatchResult` (the last stage's sampled
tokens) and :class:`StageError`. The executors pass on :data:`StageReport` messages to
the engine; the rest they consume. The engine's own input queue (fed by API threads)
holds :class:`~convergent.serve.scheduler_base.Request` and :class:`Abort`; its
listeners get a :class:`TokenEvent` per sampled token or ended request.

Times are ``time.monotonic()`` seconds of the process that measured them (all on one
host).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from convergent.serve.sampling import RowParams, TokenLogprobs

if TYPE_CHECKING:
    from convergent.serve.kv_cache import BlockManager
    from convergent.serve.scheduler_base import MicroBatch, Request

__all__ = [
    "Abort",
    "BatchMeta",
    "BatchResult",
    "Heartbeat",
    "RendezvousPort",
    "Sampled",
    "StageBusy",
    "StageError",
    "StageMessage",
    "StageReady",
    "StageReport",
    "StopStage",
    "TokenEvent",
]


@dataclass
class BatchMeta:
    """What the engine sends every stage for one micro-batch (plain lists: cheap to pickle)."""

    bid: int
    input_ids: list[int]  # packed new tokens (used by stage 0)
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # packed row of the last token of each sampled item
    sample_rids: list[int]
    sampling: RowParams = field(default_factory=RowParams)  # one row per sampled item
    # prompt logprobs (echo): packed rows whose logits score the next prompt token
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)  # the token each row scores
    prompt_rids: list[int] = field(default_factory=list)
    prompt_ks: list[int] = field(default_factory=list)  # top-k of each row

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    @classmethod
    def build(cls, batch: MicroBatch, requests: dict[int, Request], bm: BlockManager) -> BatchMeta:
        """The metadata of a scheduler's micro-batch: its tokens packed in item order, their
        KV slots and block tables, one sampling row per item that samples, and the rows
        of prompt positions whose logprobs a request still needs."""
        meta = cls(batch.bid, [], [], [], [], [], [], [], [])
        for it in batch.items:
            r = requests[it.rid]
            end = it.start + it.n
            meta._add_prompt_rows(r, it.start, end)
            meta.input_ids.extend(r.token(i) for i in range(it.start, end))
            meta.positions.extend(range(it.start, end))
            meta.slots.extend(bm.slots(it.rid, it.start, it.n))
            meta.query_lens.append(it.n)
            meta.context_lens.append(end)
            meta.block_tables.append(list(bm.tables[it.rid]))
            if it.sample:
                meta.sample_rows.append(len(meta.positions) - 1)
                meta.sample_rids.append(it.rid)
                meta.sampling.add(r.sampling, end)
        return meta

    def _add_prompt_rows(self, r: Request, start: int, end: int) -> None:
        """Rows of positions ``start..end-1`` (packed from ``len(self.positions)``) that
        score prompt tokens ``r.prompt_logprobs`` lacks: position ``p`` scores ``p + 1``."""
        k = r.sampling.prompt_logprobs
        if k < 0:
            return
        row0 = len(self.positions)
        first = max(start, len(r.prompt_logprobs) - 1)
        for p in range(first, min(end, len(r.prompt) - 1)):
            self.prompt_rows.append(row0 + p - start)
            self.prompt_targets.append(r.prompt[p + 1])
            self.prompt_rids.append(r.rid)
            self.prompt_ks.append(k)


@dataclass(frozen=True)
class StopStage:
    """Engine -> stage: finish what is in flight and exit."""


@dataclass(frozen=True)
class RendezvousPort:
    """Stage 0 -> engine, then engine -> the other stages: the TCP port of stage 0's
    rendezvous store on 127.0.0.1."""

    port: int


@dataclass(frozen=True)
class StageReady:
    """A stage loaded its layers and allocated ``kv_bytes`` of K/V cache."""

    stage: int
    kv_bytes: int


@dataclass(frozen=True)
class Heartbeat:
    """A stage process is alive (sent every ``hb_interval`` s from a side thread)."""

    stage: int


@dataclass(frozen=True)
class StageError:
    """A stage failed; ``traceback`` is its formatted traceback."""

    stage: int
    traceback: str


@dataclass(frozen=True)
class StageBusy:
    """A stage other than the last computed micro-batch ``bid`` from ``t0`` to ``t1``."""

    stage: int
    bid: int
    t0: float
    t1: float


@dataclass
class Sampled:
    """The last stage's output for one micro-batch, by request id: the sampled token and,
    where the request asks, its logprobs and those of the prompt tokens it computed."""

    tokens: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchResult:
    """The last stage computed micro-batch ``bid`` from ``t0`` to ``t1`` and sampled."""

    bid: int
    sampled: Sampled
    t0: float
    t1: float


StageReport = StageBusy | BatchResult  # what an executor's poll() returns
StageMessage = RendezvousPort | StageReady | Heartbeat | StageError | StageReport


@dataclass(frozen=True)
class Abort:
    """API thread -> engine: drop request ``rid`` (the client went away)."""

    rid: int


@dataclass(frozen=True)
class TokenEvent:
    """Engine -> its listeners: request ``rid`` sampled ``token`` (-1: it ended without
    one); ``finish_reason`` is set once ``finished``."""

    rid: int
    token: int
    finished: bool
    finish_reason: str | None = None
