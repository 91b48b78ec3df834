"""The central engine: owns the scheduler and the block manager, sends batch metadata to
the stages, collects sampled tokens, records per-stage busy time and KV usage.

Executors:

* :class:`LocalExecutor` — all stages in this process, run one after another (the
  ``sequential`` scheduler's one process; also handy in tests).
* :class:`ProcessExecutor` — one process per stage, ``torch.distributed`` point-to-point
  activations between them (gloo on CPU), metadata through queues.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from convergent.errors import ConfigError, ConvergentError, InputError
from convergent.serve.config import ServeConfig
from convergent.serve.costs import CostTable
from convergent.serve.kv_cache import BlockManager, blocks_for_budget
from convergent.serve.scheduler import (
    MicroBatch,
    Request,
    SchedulerConfig,
    make_scheduler,
)
from convergent.serve.stage import BatchMeta, StageRunner, StageSpec, split_layers

__all__ = ["Engine", "EngineStats", "LocalExecutor", "ProcessExecutor", "free_port"]


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalExecutor:
    """Runs the stages in this process, synchronously."""

    def __init__(self, specs: list[StageSpec]) -> None:
        import torch

        torch.set_num_threads(max(1, specs[0].threads))
        self.runners = [StageRunner(s) for s in specs]
        self.kv_bytes = sum(r.kv.nbytes for r in self.runners)
        self._done: list[tuple] = []

    def submit(self, meta: BatchMeta) -> None:
        x = None
        for s, r in enumerate(self.runners):
            t0 = time.monotonic()
            x = r.run(meta, x)
            t1 = time.monotonic()
            if s < len(self.runners) - 1:
                self._done.append(("busy", s, meta.bid, t0, t1))
        self._done.append(("result", meta.bid, x, t0, t1))

    def poll(self, timeout: float) -> list[tuple]:
        out, self._done = self._done, []
        return out

    def close(self) -> None:
        pass


class ProcessExecutor:
    """One spawned process per stage; see :func:`convergent.serve.stage.stage_main`."""

    def __init__(self, specs: list[StageSpec], start_timeout: float = 300.0) -> None:
        import multiprocessing as mp

        from convergent.serve.stage import stage_main

        ctx = mp.get_context("spawn")
        self.out_q = ctx.Queue()
        self.in_qs = [ctx.Queue() for _ in specs]
        port = free_port()
        self.procs = [
            ctx.Process(target=stage_main, args=(s, port, self.in_qs[i], self.out_q), daemon=True)
            for i, s in enumerate(specs)
        ]
        for p in self.procs:
            p.start()
        self.kv_bytes = 0
        ready = 0
        deadline = time.monotonic() + start_timeout
        while ready < len(specs):
            try:
                msg = self.out_q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                raise ConvergentError("pipeline stages did not start in time") from None
            if msg[0] == "error":
                self.close()
                raise RuntimeError(f"stage {msg[1]} failed:\n{msg[2]}")
            if msg[0] == "ready":
                ready += 1
                self.kv_bytes += msg[2]

    def submit(self, meta: BatchMeta) -> None:
        for i, q in enumerate(self.in_qs):
            if i == 0:
                q.put(meta)
            else:  # later stages do not need the token ids
                q.put(BatchMeta(**{**meta.__dict__, "input_ids": []}))

    def poll(self, timeout: float) -> list[tuple]:
        out = []
        try:
            out.append(self.out_q.get(timeout=timeout))
            while True:
                out.append(self.out_q.get_nowait())
        except queue.Empty:
            pass
        for m in out:
            if m[0] == "error":
                raise RuntimeError(f"stage {m[1]} failed:\n{m[2]}")
        return out

    def close(self) -> None:
        for q in self.in_qs:
            with contextlib.suppress(Exception):
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


@dataclass
class EngineStats:
    """Timings (seconds, monotonic clock) of one engine's life."""

    num_stages: int
    busy: list[list[tuple[float, float]]] = field(default_factory=list)
    kv_timeline: list[tuple[float, int]] = field(default_factory=list)  # (t, used blocks)
    batches: int = 0
    # per micro-batch: bid -> {"submit": t, "shape": [features], "stages": {s: (t0, t1)}}
    batch_log: dict[int, dict] = field(default_factory=dict)
    t_start: float = 0.0
    t_end: float = 0.0
    decide_s: float = 0.0  # engine time in the scheduler's schedule()/complete() calls

    def summary(self, num_blocks: int) -> dict:
        span = max(1e-9, self.t_end - self.t_start)
        per_stage = []
        for s, iv in enumerate(self.busy):
            b = sum(t1 - t0 for t0, t1 in iv)
            per_stage.append(
                {
                    "stage": s,
                    "busy_s": b,
                    "busy_fraction": b / span,
                    "bubble_s": span - b,
                    "batches": len(iv),
                }
            )
        return {
            "wall_s": span,
            "micro_batches": self.batches,
            "stages": per_stage,
            "kv_peak_blocks": max((u for _, u in self.kv_timeline), default=0),
            "kv_blocks": num_blocks,
            "engine_decide_s": self.decide_s,
        }


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
        scfg = SchedulerConfig.from_serve(cfg, ignore_eos)
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
            )
            for s in range(p)
        ]
        use_local = executor == "local" or (executor == "auto" and p == 1)
        self.executor = LocalExecutor(specs) if use_local else ProcessExecutor(specs)
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

    # -- requests
    def make_request(
        self,
        prompt: list[int],
        max_tokens: int,
        predicted_len: int | None = None,
        temperature: float = 0.0,
        seed: int = 0,
        stop_ids: list[int] | None = None,
    ) -> Request:
        with self._lock:
            rid = self._next_rid
            self._next_rid += 1
        stops = frozenset(self.mcfg.eos_ids if stop_ids is None else stop_ids)
        return Request(
            rid,
            list(prompt),
            int(max_tokens),
            predicted_len=int(predicted_len if predicted_len is not None else max_tokens),
            stop_ids=stops,
            temperature=float(temperature),
            seed=int(seed),
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
        return BatchMeta(b.bid, ids, pos, slots, ql, cl, bts, rows, rids, temps, seeds)

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
                _, bid, tokens, t0, t1 = m
                if self._record:
                    self.stats.busy[self.num_stages - 1].append((t0, t1))
                if bid in self.stats.batch_log:
                    self.stats.batch_log[bid]["stages"][self.num_stages - 1] = (t0, t1)
                    self.stats.batch_log[bid]["recv"] = recv
                b = self.in_flight.pop(bid)
                now = time.monotonic()
                before = {rid: len(self.sched.requests[rid].output) for rid in tokens}
                t_c = time.perf_counter()
                done = self.sched.complete(b, tokens, now)
                self.stats.decide_s += time.perf_counter() - t_c
                finished.extend(done)
                if self._record:
                    self.stats.kv_timeline.append((now, self.bm.num_used))
                if self.on_token is not None:
                    for rid, tok in tokens.items():
                        r = self.sched.requests[rid]
                        if len(r.output) > before[rid]:
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
                block = not (self.sched.has_unfinished() or self.in_flight)
                try:
                    msg = self._incoming.get(timeout=0.05) if block else self._incoming.get_nowait()
                    while True:
                        self._accept(msg)
                        msg = self._incoming.get_nowait()
                except queue.Empty:
                    pass
                self._submit_ready()
                if self.in_flight:
                    self._handle(self.executor.poll(timeout=0.02))
                else:
                    self._stalled()
                if len(self.sched.finished) > 256:
                    self.sched.prune_finished()
                self.stats.t_end = time.monotonic()
        except BaseException as exc:  # surfaced by the API as 500s
            self.error = exc
            raise

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
        self.executor.close()

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
