"""The central engine: owns the scheduler and the block manager, sends batch metadata to
the stages, collects sampled tokens, records per-stage busy time and KV usage.

Failures: online (:meth:`Engine.start`), the loop watches its executor (stage exit codes
and heartbeats, :mod:`convergent.serve.executor`). When a stage dies every request running
in the stages (admitted: it holds KV there) ends at once with ``finish_reason="error"``
and the reason in ``Request.error``, :attr:`Engine.healthy` turns false, and the pipeline
is rebuilt (weights reloaded) while the
:class:`~convergent.serve.restarts.RestartBudget` allows; requests still waiting in the
queue stay queued and run on the new pipeline. Otherwise they end too (retryable: they
never started), :attr:`Engine.error` is set, the fatal listeners are called and the engine
stops.
:meth:`Engine.begin_shutdown` ends what is still running at a deadline (SIGTERM: the API
finishes or cancels in-flight requests in bounded time).

The HTTP layer uses only public methods and properties: requests, listeners
(:meth:`~Engine.add_token_listener`, :meth:`~Engine.add_fatal_listener`) and snapshots
(:meth:`~Engine.kv_usage`, :meth:`~Engine.load`, :meth:`~Engine.serving_stats`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from convergent.core.errors import InputError
from convergent.models.layersplit import split_layers
from convergent.serve.config import ServeConfig
from convergent.serve.costs import CostTable
from convergent.serve.engine_async import AsyncOutput, async_enabled
from convergent.serve.engine_faults import FailureHandling
from convergent.serve.engine_setup import (
    check_weights,
    context_source,
    pipeline_stages,
    stage_specs,
)
from convergent.serve.executor import LocalExecutor, ProcessExecutor, StageFailure, free_port
from convergent.serve.kv_cache import BlockManager
from convergent.serve.memory import plan_memory, step_capacity
from convergent.serve.messages import (
    Abort,
    BatchMeta,
    BatchResult,
    StageBusy,
    StageReport,
    TokenEvent,
)
from convergent.serve.restarts import RestartBudget
from convergent.serve.sampling import SamplingParams
from convergent.serve.scheduler import MicroBatch, Request, make_scheduler
from convergent.serve.stats import EngineLoad, EngineStats, KVUsage, ServingStats
from convergent.serve.timing import StepTiming

__all__ = ["Engine", "EngineStats", "LocalExecutor", "ProcessExecutor", "StageFailure", "free_port"]

TokenListener = Callable[[TokenEvent], None]
FatalListener = Callable[[BaseException], None]


class Engine(FailureHandling, AsyncOutput, StepTiming):
    """Serve requests on a Llama checkpoint with a pipeline of stages and a scheduler.

    ``Engine(model_dir, cfg)``; :meth:`add_request`; then either :meth:`run` (offline:
    until all requests finish) or :meth:`start` (a background thread, for the HTTP API).
    Token listeners (:meth:`add_token_listener`) run on the engine thread.

    ``cfg`` is the ``serve`` section; the engine reads its ``engine``, ``scheduler`` and
    ``faults`` sub-sections (the API's ``http`` is the HTTP layer's). Without ``costs``,
    the stage cost table is profiled in situ at start-up (a short sweep through the stages,
    :mod:`convergent.serve.insitu`) when the scheduler is ``tdpipe`` or ``profile`` is
    true, and ``serve.scheduler.profile_costs`` allows it.
    """

    def __init__(
        self,
        model_dir: str | Path,
        cfg: ServeConfig | None = None,
        costs: CostTable | None = None,
        executor: str = "auto",
        ignore_eos: bool = False,
        profile: bool = False,
    ) -> None:
        from convergent.models.llama import read_config

        cfg = cfg or ServeConfig()
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise InputError(
                f"{model_dir}: not a Hugging Face checkpoint directory (no config.json)",
                hint="pass a directory with config.json and *.safetensors",
            )
        self.model_dir = model_dir
        check_weights(model_dir)
        self.mcfg = read_config(model_dir)
        p = self.num_stages = pipeline_stages(cfg.scheduler, cfg.engine.device, self.mcfg)
        cfg = self.cfg = self._sized(cfg, p)
        self.bm = BlockManager(self.memory.num_blocks, cfg.engine.block_size)
        layers = [len(x) for x in split_layers(self.mcfg.num_hidden_layers, p)]
        self.costs = costs.with_stages(layers) if costs is not None else None
        self.model_context = self.mcfg.max_context
        self.ignore_eos = ignore_eos
        self.sched = self._new_scheduler()
        self._specs = stage_specs(model_dir, cfg.engine, p, self.bm.num_blocks)
        for spec in self._specs:  # the step's metadata buffers, sized once
            spec.step_capacity = step_capacity(cfg.engine, cfg.scheduler)
            spec.max_num_seqs = cfg.scheduler.max_num_seqs  # the decode graphs' buckets
            spec.max_batched_tokens = cfg.scheduler.max_batched_tokens  # the mixed graphs'
        self._use_local = executor == "local" or (executor == "auto" and p == 1)
        # serve.engine.async_scheduling: token events after the next launch (engine_async)
        self.defer_events = async_enabled(cfg.engine.async_scheduling, cfg.engine.device)
        self.executor = self._make_executor()
        self.kv_bytes = self.executor.kv_bytes
        self.profile_s = 0.0
        sc = cfg.scheduler
        if costs is None and sc.profile_costs and (sc.kind == "tdpipe" or profile):
            self._profile(layers)
        self.stats = EngineStats(p, [[] for _ in range(p)])
        self.in_flight: dict[int, MicroBatch] = {}
        self._token_listeners: list[TokenListener] = []
        self._fatal_listeners: list[FatalListener] = []
        self._incoming: queue.Queue[Request | Abort] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._next_rid = 0
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._record = True  # per-batch timing log and KV timeline (off when serving)
        self.healthy = True
        self.failure: str | None = None  # the last stage failure (also after a restart)
        self.failures = RestartBudget()  # recent stage failures
        self.restarts = 0
        self._shutdown_at: float | None = None
        self.last_loop = time.monotonic()  # the engine thread's own liveness

    def _sized(self, cfg: ServeConfig, stages: int) -> ServeConfig:
        """``cfg`` with the KV budget and ``max_num_seqs`` of :func:`plan_memory` (on CUDA
        with ``kv_budget_bytes`` 0: from the GPUs' free memory; else as configured)."""
        from convergent.models.paged_decode import resolve_backend

        backend = resolve_backend(cfg.engine.attention_backend, cfg.engine.device)
        self.memory = plan_memory(cfg.engine, cfg.scheduler, self.mcfg, stages, backend)
        engine = cfg.engine.model_copy(update={"kv_budget_bytes": self.memory.kv_budget_bytes})
        sched = cfg.scheduler.model_copy(update={"max_num_seqs": self.memory.max_num_seqs})
        return cfg.model_copy(update={"engine": engine, "scheduler": sched})

    def _new_scheduler(self):
        """The scheduler of ``serve.scheduler`` on the block manager, timing queue waits with
        the monotonic clock (TD-Pipe's wait bound)."""
        return make_scheduler(
            self.cfg.scheduler,
            self.bm,
            self.num_stages,
            self.costs,
            max_model_len=min(self.cfg.engine.max_model_len, self.model_context),
            ignore_eos=self.ignore_eos,
            clock=time.monotonic,
        )

    def _profile(self, layers_per_stage: list[int]) -> None:
        """Profile the stage cost table in situ (:mod:`convergent.serve.insitu`)."""
        from convergent.serve.insitu import profile_in_situ

        t, base = time.monotonic(), CostTable(layers_per_stage=layers_per_stage)
        depth, blocks = self.sched.depth, self.bm.num_blocks
        self.costs = profile_in_situ(
            self.executor,
            base,
            depth=depth,
            num_blocks=blocks,
            engine=self.cfg.engine,
            scheduler=self.cfg.scheduler,
        )
        self.sched.costs = self.costs
        self.profile_s = time.monotonic() - t

    def _make_executor(self) -> LocalExecutor | ProcessExecutor:
        if self._use_local:
            return LocalExecutor(self._specs, defer=self.defer_events)
        return ProcessExecutor(self._specs, heartbeat_timeout=self.cfg.faults.heartbeat_timeout_s)

    # -- what the HTTP layer reads
    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (token ids are below it)."""
        return self.mcfg.vocab_size

    @property
    def context_limit(self) -> int:
        """Longest prompt + output of one request: the smallest of ``serve.engine.max_model_len``,
        the model's own context (``max_position_embeddings``, times a linear/dynamic RoPE
        factor, or Mistral's ``sliding_window``: :func:`context_source`) and the KV
        cache's capacity."""
        return min(self.cfg.engine.max_model_len, self.model_context, self.bm.capacity_tokens)

    def context_error(self, n_prompt: int, max_tokens: int) -> str | None:
        """Why ``n_prompt + max_tokens`` does not fit (naming every limit), or ``None``."""
        if n_prompt + max_tokens <= self.context_limit:
            return None
        return (
            f"This model's maximum context length is {self.context_limit} tokens "
            f"({context_source(self.mcfg)} allows {self.model_context}, the KV cache holds "
            f"{self.bm.capacity_tokens}, serve.engine.max_model_len is "
            f"{self.cfg.engine.max_model_len}). "
            f"However, you requested {n_prompt + max_tokens} tokens ({n_prompt} in the "
            f"prompt, {max_tokens} for the completion). Please reduce the prompt or max_tokens."
        )

    def kv_usage(self) -> KVUsage:
        """KV blocks: all, in use, peak (approximate when read from another thread)."""
        return KVUsage(self.bm.num_blocks, self.bm.num_used, self.bm.peak_used)

    def load(self) -> EngineLoad:
        """What the dispatcher routes by (approximate from another thread)."""
        s = self.sched
        queued = sum(len(r.prompt) + r.max_tokens for r in list(s.waiting))
        return EngineLoad(
            healthy=self.accepting,
            waiting=self.queue_length,
            running=len(s.running),
            queued_tokens=queued,
            kv_used_fraction=self.kv_usage().fraction,
        )

    def serving_stats(self) -> ServingStats:
        """The engine's state for ``GET /stats``."""
        kv = self.kv_usage()
        return ServingStats(
            scheduler=self.sched.name,
            num_stages=self.num_stages,
            kv_blocks=kv.blocks,
            kv_used_blocks=kv.used,
            kv_peak_blocks=kv.peak,
            kv_budget_bytes=self.cfg.engine.kv_budget_bytes,
            kv_allocated_bytes=self.kv_bytes,
            context_limit=self.context_limit,
            preemptions=self.sched.num_preemptions,
            restarts=self.restarts,
            last_failure=self.failure,
        )

    def add_token_listener(self, fn: TokenListener) -> None:
        """Call ``fn`` with a :class:`~convergent.serve.messages.TokenEvent` for every
        sampled token and every request that ends (on the engine thread: keep it short)."""
        self._token_listeners.append(fn)

    def add_fatal_listener(self, fn: FatalListener) -> None:
        """Call ``fn`` with the error when the engine gives up (no restart left)."""
        self._fatal_listeners.append(fn)

    def _emit(self, r: Request, token: int) -> None:
        if self._token_listeners:
            self._emit_event(TokenEvent(r.rid, token, r.finished, r.finish_reason))

    # -- requests
    def make_request(
        self,
        prompt: list[int],
        max_tokens: int,
        predicted_len: int | None = None,
        sampling: SamplingParams | None = None,
        stop_ids: list[int] | None = None,
        extra_stop_ids: list[int] | None = None,
        *,
        temperature: float | None = None,
    ) -> Request:
        """A request; ``sampling`` defaults to greedy (``temperature`` is shorthand for
        ``SamplingParams(temperature=...)``); ``stop_ids`` replaces the model's EOS ids,
        ``extra_stop_ids`` adds to them. Raises :class:`InputError` when the prompt plus
        ``max_tokens`` exceeds :attr:`context_limit` (nothing is silently truncated)."""
        if max_tokens < 1:
            raise InputError(f"max_tokens={max_tokens}: must be at least 1")
        why = self.context_error(len(prompt), int(max_tokens))
        if why is not None:
            raise InputError(why)
        if sampling is not None and temperature is not None:
            raise ValueError("pass sampling or temperature, not both")
        if sampling is None:
            sampling = SamplingParams(temperature=float(temperature or 0.0))
        with self._lock:
            rid = self._next_rid
            self._next_rid += 1
        stops = set(self.mcfg.eos_ids if stop_ids is None else stop_ids)
        stops.update(extra_stop_ids or [])
        return Request(
            rid,
            list(prompt),
            int(max_tokens),
            predicted_len=int(predicted_len if predicted_len is not None else max_tokens),
            stop_ids=frozenset(stops),
            sampling=sampling,
            arrival=time.monotonic(),
            prompt_logprobs=[None] if sampling.prompt_logprobs >= 0 else [],
        )

    def add_request(self, req: Request) -> Request:
        """Queue a request (thread-safe when the engine thread runs)."""
        if self._thread is not None:
            self._incoming.put(req)
        else:
            self.sched.add(req)
        return req

    def abort(self, rid: int) -> None:
        """Drop a request (client went away); thread-safe."""
        if self._thread is not None:
            self._incoming.put(Abort(rid))
        else:
            self.sched.abort(rid)

    # -- loop
    def _submit_ready(self) -> None:
        while len(self.in_flight) < self.sched.depth:
            t0 = time.perf_counter()
            b = self.sched.schedule()
            self.stats.decide_s += time.perf_counter() - t0
            if b is None:
                break
            self.in_flight[b.bid] = b
            self.stats.batches += 1
            meta = BatchMeta.build(b, self.sched.requests, self.bm)
            if self._record:
                self.stats.batch_log[b.bid] = {
                    "submit": time.monotonic(),
                    "shape": self.sched.batch_shape(b),
                    "stages": {},
                }
            self._timed_submit(meta)  # timed while recording (serve.timing)
            if self._record:
                self.stats.kv_timeline.append((time.monotonic(), self.bm.num_used))

    def _busy(self, stage: int, bid: int, t0: float, t1: float) -> None:
        """Record that ``stage`` computed micro-batch ``bid`` from ``t0`` to ``t1``."""
        if self._record:
            self.stats.busy[stage].append((t0, t1))
        if bid in self.stats.batch_log:
            self.stats.batch_log[bid]["stages"][stage] = (t0, t1)

    def _handle(self, msgs: list[StageReport]) -> list[Request]:
        finished = []
        recv = time.monotonic()
        for m in msgs:
            if isinstance(m, StageBusy):
                self._busy(m.stage, m.bid, m.t0, m.t1)
            elif isinstance(m, BatchResult):
                self._busy(self.num_stages - 1, m.bid, m.t0, m.t1)
                if m.bid in self.stats.batch_log:
                    self.stats.batch_log[m.bid]["recv"] = recv
                finished.extend(self._complete(m))
        return finished

    def _complete(self, m: BatchResult) -> list[Request]:
        """Apply a micro-batch's sampled tokens; tell the listeners; the requests it ended."""
        b = self.in_flight.pop(m.bid, None)
        if b is None:  # a batch of a pipeline that was replaced
            return []
        for rid, lps in m.sampled.prompt_logprobs.items():
            r = self.sched.requests.get(rid)
            if r is not None and len(r.prompt_logprobs) + len(lps) <= len(r.prompt):
                r.prompt_logprobs.extend(lps)
        tokens = m.sampled.tokens
        now = time.monotonic()
        before = {rid: len(self.sched.requests[rid].output) for rid in tokens}
        t_c = time.perf_counter()
        done = self.sched.complete(b, tokens, now)
        self.stats.decide_s += time.perf_counter() - t_c
        if self._record:
            self.stats.kv_timeline.append((now, self.bm.num_used))
        for rid, tok in tokens.items():
            r = self.sched.requests[rid]
            if len(r.output) > before[rid]:
                if r.sampling.logprobs >= 0:
                    r.token_logprobs.append(m.sampled.logprobs.get(rid))
                self._emit(r, tok)
        return done

    def _stalled(self) -> list[Request]:
        if not self.in_flight and self.sched.has_unfinished():
            r = self.sched.resolve_stall()
            if r is not None:
                self._emit(r, -1)
                return [r]
        return []

    def run(self, progress: Callable[[int], None] | None = None) -> list[Request]:
        """Offline: run until every queued request finishes; returns them (by id)."""
        self.stats.t_start = time.monotonic()
        while self.sched.has_unfinished() or self.in_flight:
            self._submit_ready()
            self._flush_events()  # the previous step's, while this one runs
            if not self.in_flight:
                self._stalled()
                continue
            done = self._handle(self._timed_poll(1.0))
            if progress and done:
                progress(len(done))
        self._flush_events()
        self.stats.t_end = time.monotonic()
        return sorted(self.sched.finished, key=lambda r: r.rid)

    def start(self) -> None:
        """Run the loop on a background thread (online serving)."""
        self.stats.t_start = time.monotonic()
        self._record = False
        self._thread = threading.Thread(target=self._loop, name="serve-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.last_loop = time.monotonic()
                try:
                    self._step()
                except Exception as exc:  # a stage died (or a bug): fail fast, maybe restart
                    self._flush_events()
                    defer, self.defer_events = self.defer_events, False  # errors at once
                    try:
                        if not self._recover(exc):
                            return
                    finally:
                        self.defer_events = defer
        except BaseException as exc:  # surfaced by the API as 503s
            self.error = exc
            self.healthy = False
            raise

    def _step(self) -> None:
        block = not (self.sched.has_unfinished() or self.in_flight)
        if block:
            self._flush_events()
        try:
            msg = self._incoming.get(timeout=0.05) if block else self._incoming.get_nowait()
            while True:
                self._accept(msg)
                msg = self._incoming.get_nowait()
        except queue.Empty:
            pass
        if self._shutdown_at is not None and time.monotonic() >= self._shutdown_at:
            self._fail_all("the server is shutting down")
        self._submit_ready()
        self._flush_events()  # the previous step's events while this one runs
        if self.in_flight:
            self._handle(self.executor.poll(timeout=0.02))
        else:
            self._stalled()
            self.executor.check()
        if len(self.sched.finished) > 256:
            self.sched.prune_finished()
        self.stats.t_end = time.monotonic()

    def _accept(self, msg: Request | Abort) -> None:
        if isinstance(msg, Abort):
            self.sched.abort(msg.rid)
            return
        self.sched.add(msg)
        if msg.finished:  # it can never fit: ended at once
            self._emit(msg, -1)

    @property
    def queue_length(self) -> int:
        """Requests waiting for admission (approximate when read from another thread)."""
        return len(self.sched.waiting) + self._incoming.qsize()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.executor.close(kill=self.error is not None or not self.healthy)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def summary(self) -> dict:
        s = self.stats.summary(self.bm.num_blocks)
        s.update(self.timing_summary())  # step split, TTFT/TPOT (serve.timing)
        runners = getattr(self.executor, "runners", [])  # in process
        s.update({
                "scheduler": self.sched.name,
                "num_stages": self.num_stages,
                "kv_budget_bytes": self.cfg.engine.kv_budget_bytes,
                "kv_budget_source": self.memory.source,
                "max_num_seqs": self.cfg.scheduler.max_num_seqs,
                "kv_allocated_bytes": self.kv_bytes,
                "kv_peak_blocks_manager": self.bm.peak_used,
                "preemptions": self.sched.num_preemptions,
                "mode_switches": getattr(self.sched, "mode_switches", None),
                "aged_switches": getattr(self.sched, "aged_switches", None),
                "decode_graph_steps": sum(r.graphs.replays + r.graphs.static_runs
                                          for r in runners if r.graphs),
                "mixed_graph_steps": sum(r.mixed.replays + r.mixed.static_runs
                                         for r in runners if r.mixed),
                "compiled_decode_steps": sum(r.compiled.steps for r in runners if r.compiled)})
        return s
