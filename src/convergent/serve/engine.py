"""The central engine: owns the scheduler and the block manager, sends batch metadata to
the stages, collects sampled tokens, records per-stage busy time and KV usage.

Failures: online (:meth:`Engine.start`), the loop watches its executor (stage exit codes
and heartbeats, :mod:`convergent.serve.executor`). When a stage dies every unfinished
request ends at once with ``finish_reason="error"`` and the reason in ``Request.error``,
:attr:`Engine.healthy` turns false, and the pipeline is rebuilt (weights reloaded) while
``serve.restart_on_failure`` allows and fewer than ``serve.max_restarts`` failures
happened in the last 10 minutes; otherwise :attr:`Engine.error` is set, ``on_fatal`` is
called and the engine stops. :meth:`Engine.begin_shutdown` ends what is still running at
a deadline (SIGTERM: the API finishes or cancels in-flight requests in bounded time).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

from convergent.errors import ConfigError, InputError
from convergent.serve.config import ServeConfig
from convergent.serve.costs import CostTable
from convergent.serve.executor import LocalExecutor, ProcessExecutor, StageFailure, free_port
from convergent.serve.kv_cache import BlockManager, blocks_for_budget
from convergent.serve.scheduler import (
    MicroBatch,
    Request,
    SchedulerConfig,
    make_scheduler,
)
from convergent.serve.stage import BatchMeta, StageSpec, split_layers
from convergent.serve.stats import EngineStats

__all__ = ["Engine", "EngineStats", "LocalExecutor", "ProcessExecutor", "StageFailure", "free_port"]

FAILURE_WINDOW_S = 600.0  # serve.max_restarts counts failures within this window


class Engine:
    """Serve requests on a Llama checkpoint with a pipeline of stages and a scheduler.

    ``Engine(model_dir, cfg)``; :meth:`add_request`; then either :meth:`run` (offline:
    until all requests finish) or :meth:`start` (a background thread, for the HTTP API).
    ``on_token(req, token, finished)`` callbacks run on the engine thread.

    Without ``costs``, the stage cost table is profiled in situ at start-up (a short
    sweep through the stages, :mod:`convergent.serve.insitu`) when the scheduler is
    ``tdpipe`` or ``profile`` is true, and ``cfg.profile_costs`` allows it.
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
        self.cfg = cfg
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise InputError(
                f"{model_dir}: not a Hugging Face checkpoint directory (no config.json)",
                hint="pass a directory with config.json and *.safetensors",
            )
        self.model_dir = model_dir
        self.mcfg = read_config(model_dir)
        p = 1 if cfg.scheduler == "sequential" else cfg.stages
        if p < 1 or p > self.mcfg.num_hidden_layers:
            raise ConfigError(
                f"serve.stages={cfg.stages}: must be between 1 and the model's "
                f"{self.mcfg.num_hidden_layers} layers"
            )
        from convergent.placement import check_serve_stages, visible_gpus

        # one GPU per stage: too many stages for the GPUs is a one-line error (exit 2)
        check_serve_stages(cfg.device, p, visible_gpus() if cfg.device == "cuda" else 0)
        self.num_stages = p
        dtype_bytes = 4 if cfg.dtype == "float32" else 2
        num_blocks = blocks_for_budget(
            cfg.kv_budget_bytes,
            self.mcfg.kv_bytes_per_token(dtype_bytes=dtype_bytes),
            cfg.block_size,
        )
        if num_blocks < 1:
            raise ConfigError(
                f"serve.kv_budget_bytes={cfg.kv_budget_bytes} is smaller than one KV block",
                hint=f"one block needs {self.mcfg.kv_bytes_per_token(dtype_bytes=dtype_bytes) * cfg.block_size} bytes",
            )
        self.bm = BlockManager(num_blocks, cfg.block_size)
        layers = split_layers(self.mcfg.num_hidden_layers, p)
        if costs is not None:
            costs = costs.with_stages([len(x) for x in layers])
        self.costs = costs
        self.model_context = self.mcfg.max_context
        scfg = SchedulerConfig.from_serve(cfg, ignore_eos)
        scfg.max_model_len = min(cfg.max_model_len, self.model_context)
        self._scfg = scfg
        self.sched = make_scheduler(cfg.scheduler, scfg, self.bm, p, costs)
        specs = [
            StageSpec(
                str(model_dir),
                s,
                p,
                num_blocks,
                cfg.block_size,
                cfg.dtype,
                cfg.torch_threads,
                cfg.device,
                cfg.quantize,
            )
            for s in range(p)
        ]
        self._specs = specs
        self._use_local = executor == "local" or (executor == "auto" and p == 1)
        self.executor = self._make_executor()
        self.kv_bytes = self.executor.kv_bytes
        self.profile_s = 0.0
        if costs is None and cfg.profile_costs and (cfg.scheduler == "tdpipe" or profile):
            from convergent.serve.insitu import profile_in_situ

            t = time.monotonic()
            self.costs = profile_in_situ(
                self.executor,
                self.sched.depth,
                CostTable(layers_per_stage=[len(x) for x in layers]),
                num_blocks,
                cfg.block_size,
                cfg.max_batched_tokens,
                cfg.max_num_seqs,
                cfg.max_model_len,
            )
            self.sched.costs = self.costs
            self.profile_s = time.monotonic() - t
        self.stats = EngineStats(p, [[] for _ in range(p)])
        self.in_flight: dict[int, MicroBatch] = {}
        self.on_token: Callable[[Request, int, bool], None] | None = None
        self._incoming: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._next_rid = 0
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._record = True  # per-batch timing log and KV timeline (off when serving)
        self.healthy = True
        self.failure: str | None = None  # the last stage failure (also after a restart)
        self.failures: list[float] = []  # times of stage failures
        self.restarts = 0
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._shutdown_at: float | None = None
        self.last_loop = time.monotonic()  # the engine thread's own liveness

    def _make_executor(self):
        if self._use_local:
            return LocalExecutor(self._specs)
        return ProcessExecutor(self._specs, heartbeat_timeout=self.cfg.heartbeat_timeout_s)

    @property
    def context_limit(self) -> int:
        """Longest prompt + output of one request: the smallest of ``serve.max_model_len``,
        the model's own context (``max_position_embeddings``, times a linear/dynamic RoPE
        factor) and the KV cache's capacity."""
        return min(self.cfg.max_model_len, self.model_context, self.bm.capacity_tokens)

    def context_error(self, n_prompt: int, max_tokens: int) -> str | None:
        """Why ``n_prompt + max_tokens`` does not fit (naming every limit), or ``None``."""
        if n_prompt + max_tokens <= self.context_limit:
            return None
        return (
            f"This model's maximum context length is {self.context_limit} tokens "
            f"(max_position_embeddings allows {self.model_context}, the KV cache holds "
            f"{self.bm.capacity_tokens}, serve.max_model_len is {self.cfg.max_model_len}). "
            f"However, you requested {n_prompt + max_tokens} tokens ({n_prompt} in the "
            f"prompt, {max_tokens} for the completion). Please reduce the prompt or max_tokens."
        )

    # -- requests
    def make_request(
        self,
        prompt: list[int],
        max_tokens: int,
        predicted_len: int | None = None,
        temperature: float = 0.0,
        seed: int | None = 0,
        stop_ids: list[int] | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
        logprobs: int = -1,
        extra_stop_ids: list[int] | None = None,
    ) -> Request:
        """A request; ``stop_ids`` replaces the model's EOS ids, ``extra_stop_ids`` adds to
        them; ``seed=None`` draws one. Raises :class:`InputError` when the prompt plus
        ``max_tokens`` exceeds :attr:`context_limit` (nothing is silently truncated)."""
        if max_tokens < 1:
            raise InputError(f"max_tokens={max_tokens}: must be at least 1")
        why = self.context_error(len(prompt), int(max_tokens))
        if why is not None:
            raise InputError(why)
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
            temperature=float(temperature),
            seed=random.getrandbits(31) if seed is None else int(seed),
            top_k=int(top_k),
            top_p=float(top_p),
            logprobs=int(logprobs),
            arrival=time.monotonic(),
        )

    def add_request(self, req: Request) -> Request:
        """Queue a request (thread-safe when the engine thread runs)."""
        if self._thread is not None:
            self._incoming.put(req)
        else:
            self.sched.add(req)
        return req

    # -- loop
    def _meta(self, b: MicroBatch) -> BatchMeta:
        ids, pos, slots, ql, cl, bts, rows, rids, temps, seeds = ([] for _ in range(10))
        tks, tps, lps = [], [], []
        for it in b.items:
            r = self.sched.requests[it.rid]
            ids.extend(r.token(i) for i in range(it.start, it.start + it.n))
            pos.extend(range(it.start, it.start + it.n))
            slots.extend(self.bm.slots(it.rid, it.start, it.n))
            ql.append(it.n)
            cl.append(it.start + it.n)
            bts.append(list(self.bm.tables[it.rid]))
            if it.sample:
                rows.append(len(pos) - 1)
                rids.append(it.rid)
                temps.append(r.temperature)
                seeds.append(r.seed * 1_000_003 + it.start + it.n)
                tks.append(r.top_k)
                tps.append(r.top_p)
                lps.append(r.logprobs)
        return BatchMeta(
            b.bid, ids, pos, slots, ql, cl, bts, rows, rids, temps, seeds, tks, tps, lps
        )

    def _submit_ready(self) -> None:
        while len(self.in_flight) < self.sched.depth:
            t0 = time.perf_counter()
            b = self.sched.schedule()
            self.stats.decide_s += time.perf_counter() - t0
            if b is None:
                break
            self.in_flight[b.bid] = b
            self.stats.batches += 1
            meta = self._meta(b)
            shape = self.sched.batch_shape(b)
            if self._record:
                self.stats.batch_log[b.bid] = {
                    "submit": time.monotonic(),
                    "shape": shape,
                    "stages": {},
                }
            self.executor.submit(meta)
            if self._record:
                self.stats.kv_timeline.append((time.monotonic(), self.bm.num_used))

    def _handle(self, msgs: list[tuple]) -> list[Request]:
        finished = []
        recv = time.monotonic()
        for m in msgs:
            if m[0] == "busy":
                if self._record:
                    self.stats.busy[m[1]].append((m[3], m[4]))
                if m[2] in self.stats.batch_log:
                    self.stats.batch_log[m[2]]["stages"][m[1]] = (m[3], m[4])
            elif m[0] == "result":
                _, bid, tokens, t0, t1, lps = m
                if self._record:
                    self.stats.busy[self.num_stages - 1].append((t0, t1))
                if bid in self.stats.batch_log:
                    self.stats.batch_log[bid]["stages"][self.num_stages - 1] = (t0, t1)
                    self.stats.batch_log[bid]["recv"] = recv
                b = self.in_flight.pop(bid, None)
                if b is None:  # a batch of a pipeline that was replaced
                    continue
                now = time.monotonic()
                before = {rid: len(self.sched.requests[rid].output) for rid in tokens}
                t_c = time.perf_counter()
                done = self.sched.complete(b, tokens, now)
                self.stats.decide_s += time.perf_counter() - t_c
                finished.extend(done)
                if self._record:
                    self.stats.kv_timeline.append((now, self.bm.num_used))
                for rid, tok in tokens.items():
                    r = self.sched.requests[rid]
                    if len(r.output) > before[rid]:
                        if r.logprobs >= 0:
                            r.token_logprobs.append(lps.get(rid))
                        if self.on_token is not None:
                            self.on_token(r, tok, r.state == "finished")
        return finished

    def _stalled(self) -> list[Request]:
        if not self.in_flight and self.sched.has_unfinished():
            r = self.sched.resolve_stall()
            if r is not None:
                if self.on_token is not None:
                    self.on_token(r, -1, True)
                return [r]
        return []

    def run(self, progress: Callable[[int], None] | None = None) -> list[Request]:
        """Offline: run until every queued request finishes; returns them (by id)."""
        self.stats.t_start = time.monotonic()
        n_done = 0
        while self.sched.has_unfinished() or self.in_flight:
            self._submit_ready()
            if not self.in_flight:
                n_done += len(self._stalled())
                continue
            done = self._handle(self.executor.poll(timeout=1.0))
            n_done += len(done)
            if progress and done:
                progress(len(done))
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
                    if not self._recover(exc):
                        return
        except BaseException as exc:  # surfaced by the API as 503s
            self.error = exc
            self.healthy = False
            raise

    def _step(self) -> None:
        block = not (self.sched.has_unfinished() or self.in_flight)
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
        if self.in_flight:
            self._handle(self.executor.poll(timeout=0.02))
        else:
            self._stalled()
            self.executor.check()
        if len(self.sched.finished) > 256:
            self.sched.prune_finished()
        self.stats.t_end = time.monotonic()

    def _fail_all(self, reason: str, reset: bool = False) -> None:
        """End every unfinished request with ``finish_reason="error"``; with ``reset`` (the
        pipeline died: nothing in flight survives) also a fresh scheduler and KV map."""
        reqs = [*self.sched.running, *self.sched.waiting]
        if reset:
            self.in_flight.clear()
            self.bm = BlockManager(self.bm.num_blocks, self.bm.block_size)
            self.sched = make_scheduler(
                self.cfg.scheduler, self._scfg, self.bm, self.num_stages, self.costs
            )
        for r in reqs:
            r.retryable = not (r.in_flight or r.num_computed or r.output)
            if not reset:
                self.sched.abort(r.rid)
            r.state, r.finish_reason, r.error = "finished", "error", reason
            if reset:
                r.in_flight = False
            if self.on_token is not None:
                self.on_token(r, -1, True)

    def _recover(self, exc: Exception) -> bool:
        """After a failure: end all requests, then restart the pipeline (true) or give up."""
        reason = str(exc) if isinstance(exc, StageFailure) else f"engine error: {exc!r}"
        self.healthy = False
        self.failure = reason
        now = time.monotonic()
        self.failures = [t for t in self.failures if now - t < FAILURE_WINDOW_S] + [now]
        self._fail_all(reason, reset=True)
        self.executor.close(kill=True)
        while self.cfg.restart_on_failure and len(self.failures) <= self.cfg.max_restarts:
            if self._stop.is_set():
                return False
            try:
                self.executor = self._make_executor()
            except Exception as again:
                self.failures.append(time.monotonic())
                self.failure = f"{reason}; restart failed: {again}"
                time.sleep(min(5.0, 0.5 * len(self.failures)))
                continue
            self.restarts += 1
            self.healthy = True
            return True
        self.error = StageFailure(
            f"{reason} (no restart: serve.restart_on_failure={self.cfg.restart_on_failure}, "
            f"{len(self.failures)} failure(s) in {FAILURE_WINDOW_S:.0f} s, "
            f"serve.max_restarts={self.cfg.max_restarts})"
        )
        if self.on_fatal is not None:
            self.on_fatal(self.error)
        return False

    def begin_shutdown(self, timeout_s: float) -> None:
        """Stop accepting (the API checks :attr:`accepting`); requests still running after
        ``timeout_s`` end with an error. Thread-safe."""
        self._shutdown_at = time.monotonic() + max(0.0, timeout_s)

    @property
    def accepting(self) -> bool:
        return self.healthy and self.error is None and self._shutdown_at is None

    @property
    def shutting_down(self) -> bool:
        return self._shutdown_at is not None

    @property
    def queue_length(self) -> int:
        """Requests waiting for admission (approximate when read from another thread)."""
        return len(self.sched.waiting) + self._incoming.qsize()

    def _accept(self, msg) -> None:
        if isinstance(msg, tuple):  # ("abort", rid)
            self.sched.abort(msg[1])
            return
        self.sched.add(msg)
        if msg.state == "finished" and self.on_token is not None:
            self.on_token(msg, -1, True)

    def abort(self, rid: int) -> None:
        """Drop a request (client went away); thread-safe."""
        if self._thread is not None:
            self._incoming.put(("abort", rid))
        else:
            self.sched.abort(rid)

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
        s.update(
            {
                "scheduler": self.sched.name,
                "num_stages": self.num_stages,
                "kv_budget_bytes": self.cfg.kv_budget_bytes,
                "kv_allocated_bytes": self.kv_bytes,
                "kv_peak_blocks_manager": self.bm.peak_used,
                "preemptions": self.sched.num_preemptions,
                "mode_switches": getattr(self.sched, "mode_switches", None),
            }
        )
        return s
