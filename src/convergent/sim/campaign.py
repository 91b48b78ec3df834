"""The simulation campaign: a fault-tolerant task farm on Dask that streams into a dataset.

>>> summary = run_campaign(SimulateConfig(), ClusterConfig(), Path("runs/x/data/sim"))
>>> summary.done, summary.quarantined, summary.frames_per_s

How it works:

* **Plan.** Molecules from the source are expanded into frames with deterministic keys
  ``s<seed>/<molecule_id>/<sampler tag>/<frame>`` and grouped into tasks: ``chunk_size``
  rattled frames per task, or one Langevin trajectory of ``md_frames`` frames per task.
  Every frame depends only on (seed, molecule, frame index), never on chunking or order.
* **Run.** Tasks are Dask futures (a bounded number in flight). Each task runs a watchdog:
  past ``timeout_s`` it reports a timeout and ends its worker process (the nanny restarts
  it); a driver-side :class:`Backstop` restarts a worker whose task is wedged so hard that
  the watchdog cannot run (native code holding the GIL). A failure that belongs to one
  structure (SCF not converged, bad geometry) is quarantined inside the task; a task that
  fails as a whole (worker crash, timeout, unexpected error) is retried ``retries`` times,
  then split into single frames, and what still fails is quarantined with its reason.
  The campaign never stops on a failure.
* **Stream.** Results go into :class:`~convergent.data.writer.DatasetWriter` as tasks
  complete (no file per calculation); the writer is flushed (shard sealed, manifest
  committed) at most every ``flush_every_s`` seconds and at the end. Quarantined frames go
  to ``<dataset>/quarantine.jsonl`` (appended and fsynced per task).
* **Resume.** Re-running the same campaign on the same dataset reads the committed keys
  and the quarantine file and submits only tasks with missing keys; a recomputed task
  writes only its missing keys, so no record is ever duplicated. ``<dataset>/campaign.json``
  holds the fingerprint of the settings that determine the records; a different campaign
  on the same dataset is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convergent.errors import ConfigError, DataError
from convergent.fsutil import atomic_write_text
from convergent.sim.calculators import (
    CalcSpec,
    CalculationError,
    Labeller,
    check_geometry,
    make_calculator,
)
from convergent.sim.config import ClusterConfig, SimulateConfig
from convergent.sim.samplers import langevin_frames, rattle_positions
from convergent.sim.sources import InputRejection, Molecule, load_molecules

QUARANTINE_NAME = "quarantine.jsonl"
CAMPAIGN_NAME = "campaign.json"
TIMEOUT_TOPIC = "convergent-timeout"


# ============================================================================ tasks


@dataclass
class FrameItem:
    """One single point to compute: a structure and its record key."""

    key: str
    molecule_id: str
    numbers: np.ndarray  # int64[N]
    positions: np.ndarray  # float64[N, 3], Å
    charge: int = 0
    multiplicity: int = 1
    meta: dict[str, Any] = field(default_factory=dict)  # sampler provenance
    # (sigma Å, seed, frame): the worker adds a seeded Gaussian rattle to ``positions``,
    # so the driver keeps one shared array per molecule instead of one per frame
    rattle: tuple[float, int, int] | None = None

    def structure(self) -> np.ndarray:
        """The positions to compute (Å), with the rattle applied if there is one."""
        if self.rattle is None:
            return self.positions
        sigma, seed, frame = self.rattle
        return rattle_positions(self.positions, sigma, seed, self.molecule_id, frame)


@dataclass
class FramesTask:
    """A chunk of independent single points (rattle frames, relabelling)."""

    task_id: str
    items: list[FrameItem]
    calc: CalcSpec
    min_distance: float = 0.5
    timeout_s: float = 300.0
    splittable: bool = True

    @property
    def keys(self) -> list[str]:
        return [it.key for it in self.items]

    def molecule_of(self, key: str) -> str:
        for it in self.items:
            if it.key == key:
                return it.molecule_id
        return ""

    def split(self) -> list[FramesTask]:
        """One task per frame (used after the chunk failed ``retries + 1`` times)."""
        return [
            FramesTask(f"{self.task_id}.{i}", [it], self.calc, self.min_distance,
                       self.timeout_s, splittable=False)
            for i, it in enumerate(self.items)
        ]


@dataclass
class MDTask:
    """One seeded Langevin trajectory; its frames are labelled by the MD force calls."""

    task_id: str
    molecule: Molecule
    temperature: float  # K
    replica: int
    frame_keys: list[str]
    calc: CalcSpec
    seed: int = 0
    interval: int = 10
    warmup: int = 20
    timestep_fs: float = 0.5
    friction: float = 0.01  # 1/fs
    min_distance: float = 0.5
    timeout_s: float = 300.0
    splittable: bool = False

    @property
    def keys(self) -> list[str]:
        return list(self.frame_keys)

    def molecule_of(self, key: str) -> str:
        return self.molecule.molecule_id


Task = FramesTask | MDTask


@dataclass
class TaskResult:
    """What a task sends back: records, per-frame quarantine entries and timings."""

    task_id: str
    records: list[dict[str, Any]]
    quarantined: list[dict[str, Any]]
    calc_s: float  # seconds inside calculator calls
    n_calcs: int  # calculator calls (MD: every step)
    wall_s: float  # seconds of the whole task on the worker
    host: str
    pid: int


# ============================================================================ worker side

_HOST = socket.gethostname()


def _watchdog(dask_key: str, timeout_s: float) -> threading.Timer | None:
    """Arm a timer that reports a timeout and ends this worker process after ``timeout_s``.

    Python cannot interrupt a calculation running in native code, so the only reliable
    way to stop it is to end the process; the Dask nanny starts a fresh worker and the
    scheduler reports the task as failed (``KilledWorker``) to the driver.
    """
    if not timeout_s or timeout_s <= 0:
        return None
    worker = None
    with contextlib.suppress(Exception):  # get_worker() works only in the task's thread
        from distributed import get_worker

        worker = get_worker()

    def fire() -> None:
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.log_event(TIMEOUT_TOPIC, {"key": dask_key, "timeout_s": timeout_s})
                # let the batched stream deliver the event before the process ends
                deadline = time.monotonic() + 5.0
                stream = getattr(worker, "batched_stream", None)
                while stream is not None and stream.buffer and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.2)
        os._exit(75)

    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    timer.start()
    return timer


def _record(item_key: str, mol_id: str, numbers, positions, charge, mult, energy, forces,
            meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "key": item_key,
        "molecule_id": mol_id,
        "numbers": np.asarray(numbers, dtype=np.int64),
        "positions": np.asarray(positions, dtype=np.float64),
        "energy": float(energy),
        "forces": np.asarray(forces, dtype=np.float64),
        "cell": np.zeros((3, 3)),
        "pbc": np.zeros(3, dtype=bool),
        "charge": int(charge),
        "multiplicity": int(mult),
        "meta": meta,
    }


def _quarantine_entry(key: str, molecule_id: str, reason: str, **extra: Any) -> dict[str, Any]:
    return {"key": key, "molecule_id": molecule_id, "reason": reason, "time": time.time(),
            "host": _HOST, **extra}


def _run_frames(task: FramesTask) -> TaskResult:
    t0 = time.perf_counter()
    lab = Labeller(task.calc, task.min_distance)
    prov = task.calc.provenance()
    records, quarantined = [], []
    calc_s = 0.0
    for it in task.items:
        positions = it.structure()
        try:
            energy, forces, wall = lab.label(it.numbers, positions, it.charge, it.multiplicity)
        except CalculationError as exc:
            quarantined.append(_quarantine_entry(it.key, it.molecule_id, str(exc),
                                                 kind=type(exc).__name__))
            continue
        calc_s += wall
        meta = {**prov, "wall_s": round(wall, 6), "host": _HOST, **it.meta}
        records.append(_record(it.key, it.molecule_id, it.numbers, positions, it.charge,
                               it.multiplicity, energy, forces, meta))
    return TaskResult(task.task_id, records, quarantined, calc_s, len(task.items),
                      time.perf_counter() - t0, _HOST, os.getpid())


def _run_md(task: MDTask) -> TaskResult:
    t0 = time.perf_counter()
    mol = task.molecule
    prov = task.calc.provenance()
    records, quarantined = [], []
    calc_s = 0.0
    n_done = 0
    try:
        check_geometry(mol.numbers, mol.positions, task.min_distance)
        calc = make_calculator(task.calc, mol.charge, mol.multiplicity)
        frames = langevin_frames(
            mol, calc, task.temperature, len(task.frame_keys), task.interval, task.warmup,
            task.timestep_fs, task.friction, task.seed, task.replica,
        )
        for fr in frames:
            key = task.frame_keys[fr.index]
            calc_s += fr.wall_s
            n_done += 1
            check_geometry(mol.numbers, fr.positions, task.min_distance)
            if not np.isfinite(fr.energy) or not np.all(np.isfinite(fr.forces)):
                raise CalculationError("non-finite energy or forces")
            meta = {**prov, "wall_s": round(fr.wall_s, 6), "host": _HOST, "sampler": "md",
                    "temperature": task.temperature, "replica": task.replica, "step": fr.step,
                    "frame": fr.index, "timestep_fs": task.timestep_fs,
                    "friction": task.friction, "seed": task.seed, "origin": mol.origin}
            records.append(_record(key, mol.molecule_id, mol.numbers, fr.positions, mol.charge,
                                   mol.multiplicity, fr.energy, fr.forces, meta))
    except Exception as exc:  # the trajectory cannot go on: quarantine its remaining frames
        from ase.calculators.calculator import CalculationFailed

        if not isinstance(exc, CalculationError | CalculationFailed | RuntimeError | ValueError):
            raise
        reason = f"md at {task.temperature:g} K stopped after {len(records)} frames: {exc}"
        for key in task.frame_keys[len(records):]:
            quarantined.append(_quarantine_entry(key, mol.molecule_id, reason,
                                                 kind=type(exc).__name__))
    steps = task.warmup + task.interval * max(n_done, 1)
    return TaskResult(task.task_id, records, quarantined, calc_s, steps,
                      time.perf_counter() - t0, _HOST, os.getpid())


def execute_task(task: Task, dask_key: str = "") -> TaskResult:
    """Run one task on a worker (also usable in-process). Guarded by a timeout watchdog."""
    timer = _watchdog(dask_key, task.timeout_s) if dask_key else None
    try:
        if isinstance(task, MDTask):
            return _run_md(task)
        return _run_frames(task)
    finally:
        if timer is not None:
            timer.cancel()


def execute_task_packed(task: Task, dask_key: str = "") -> bytes:
    """:func:`execute_task`, its result pickled on the worker into one in-band blob.

    One bytes frame per task instead of hundreds of small out-of-band numpy frames: the
    driver's event loop (which also runs the scheduler of a LocalCluster) stays idle.
    """
    return pickle.dumps(execute_task(task, dask_key), protocol=pickle.HIGHEST_PROTOCOL)


# ============================================================================ planning


def frame_key(seed: int, molecule_id: str, tag: str, index: int) -> str:
    """The record key of frame ``index`` of ``molecule_id`` (deterministic)."""
    return f"s{seed}/{molecule_id}/{tag}/{index:05d}"


def plan_tasks(sim: SimulateConfig, molecules: list[Molecule]) -> list[Task]:
    """Split the campaign into tasks, deterministically (same config -> same tasks/keys)."""
    calc = CalcSpec.from_simulate(sim)
    n_mol = len(molecules)
    tasks: list[Task] = []
    if sim.sampler == "rattle":
        base, extra = divmod(sim.frames, n_mol)
        items: list[FrameItem] = []
        tag = "rattle"
        for m_idx, mol in enumerate(molecules):
            for j in range(base + (1 if m_idx < extra else 0)):
                meta = {"sampler": "rattle", "sigma": sim.rattle_sigma, "frame": j,
                        "seed": sim.seed, "origin": mol.origin}
                items.append(FrameItem(frame_key(sim.seed, mol.molecule_id, tag, j),
                                       mol.molecule_id, mol.numbers, mol.positions, mol.charge,
                                       mol.multiplicity, meta,
                                       rattle=(sim.rattle_sigma, sim.seed, j)))
        for c in range(0, len(items), sim.chunk_size):
            tasks.append(FramesTask(f"r{c // sim.chunk_size:05d}", items[c:c + sim.chunk_size],
                                    calc, sim.min_distance, sim.timeout_s))
        return tasks
    # md: trajectory t -> (molecule, temperature) combination, replica
    temps = list(sim.temperatures)
    n_combo = n_mol * len(temps)
    n_traj = -(-sim.frames // sim.md_frames)
    for t in range(n_traj):
        combo, replica = t % n_combo, t // n_combo
        mol = molecules[combo // len(temps)]
        temp = float(temps[combo % len(temps)])
        n = min(sim.md_frames, sim.frames - t * sim.md_frames)
        tag = f"md{temp:g}K-r{replica}"
        keys = [frame_key(sim.seed, mol.molecule_id, tag, j) for j in range(n)]
        tasks.append(MDTask(f"m{t:05d}", mol, temp, replica, keys, calc, sim.seed,
                            sim.md_interval, sim.md_warmup, sim.md_timestep_fs,
                            sim.md_friction, sim.min_distance, sim.timeout_s))
    return tasks


def _file_digest(spec: str) -> str | None:
    """blake2b of a source file named in ``spec`` (None for built-in collections)."""
    low = spec.lower()
    if low in ("g2", "s22", "nci"):
        return None
    path = Path(spec.split(":", 1)[1]) if low.startswith(("smiles:", "xyz:", "extxyz:")) else Path(spec)
    try:
        return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()
    except OSError:
        return None


def campaign_fingerprint(sim: SimulateConfig) -> dict[str, Any]:
    """The settings that determine the records of a campaign (not ``frames`` or chunking)."""
    d = sim.model_dump(mode="json")
    keep = ["source", "elements", "min_atoms", "max_atoms", "max_molecules", "sampler",
            "seed", "min_distance"]
    if sim.sampler == "rattle":
        keep += ["rattle_sigma"]
    else:
        keep += ["temperatures", "md_timestep_fs", "md_friction", "md_interval", "md_warmup",
                 "md_frames"]
    out = {k: d[k] for k in keep}
    out["source_digest"] = _file_digest(sim.source)
    out["calculator"] = CalcSpec.from_simulate(sim).to_dict()
    return out


# ============================================================================ driver


@dataclass
class CampaignSummary:
    """Outcome of one :func:`run_campaign` / :func:`relabel` call.

    ``done``: records written in this call; ``skipped``: frames already present from an
    earlier run; ``quarantined``: frames quarantined in this call; ``retried``: task
    re-submissions (failed attempts); ``wall_s``: whole call including cluster start-up;
    ``frames_per_s`` = done / wall_s; ``mean_calc_s``: mean seconds of one calculation.
    """

    done: int = 0
    retried: int = 0
    quarantined: int = 0
    wall_s: float = 0.0
    frames_per_s: float = 0.0
    mean_calc_s: float = 0.0
    skipped: int = 0
    tasks: int = 0
    tasks_run: int = 0
    split: int = 0
    input_rejected: int = 0
    n_workers: int = 0
    compute_wall_s: float = 0.0  # first submission to last result
    calc_s: float = 0.0  # summed calculator seconds
    n_calcs: int = 0  # calculator calls (MD: every step)
    task_wall_s: float = 0.0  # summed task seconds on workers
    total_frames: int = 0
    dataset: str = ""
    quarantine_file: str = ""
    dashboard: str | None = None
    reasons: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """One human line: done / retried / quarantined, wall time, frames/s."""
        return (
            f"done {self.done}  skipped {self.skipped}  retried {self.retried}  "
            f"quarantined {self.quarantined}  wall {self.wall_s:.1f} s  "
            f"{self.frames_per_s:.1f} frames/s  mean calc {self.mean_calc_s * 1e3:.1f} ms"
        )


class QuarantineLog:
    """Append-only JSONL of quarantined frames/inputs; fsynced per append; torn lines ignored."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def keys(self) -> set[str]:
        return {e["key"] for e in self.entries() if "key" in e}

    def entries(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
        return out

    def append(self, entries: Iterable[dict[str, Any]]) -> int:
        lines = [json.dumps(e, default=str) + "\n" for e in entries]
        if not lines:
            return 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.writelines(lines)
            fh.flush()
            os.fsync(fh.fileno())
        return len(lines)


def _existing_keys(dataset: Path) -> set[str]:
    from convergent.data.format import MANIFEST_NAME

    if not (dataset / MANIFEST_NAME).is_file():
        return set()
    from convergent.data.reader import open_dataset

    ds = open_dataset(dataset)
    try:
        return set(ds.keys())
    finally:
        ds.close()


def _check_fingerprint(dataset: Path, fingerprint: dict[str, Any], what: str) -> None:
    """Write ``campaign.json`` on first use; refuse a dataset made by different settings."""
    from convergent.data.format import MANIFEST_NAME

    meta_path = dataset / CAMPAIGN_NAME
    if meta_path.is_file():
        try:
            previous = json.loads(meta_path.read_text(encoding="utf-8")).get("fingerprint", {})
        except json.JSONDecodeError:
            previous = None
        if previous != json.loads(json.dumps(fingerprint)):
            changed = sorted(
                k for k in set(previous or {}) | set(fingerprint)
                if (previous or {}).get(k) != json.loads(json.dumps(fingerprint)).get(k)
            )
            raise ConfigError(
                f"{dataset} holds records of a different {what} (changed: {', '.join(changed)})",
                hint="use the same settings to resume it, or write to another dataset path",
            )
        return
    if (dataset / MANIFEST_NAME).is_file():
        raise DataError(
            f"{dataset} is an existing dataset not written by a {what}",
            hint="choose another output path",
        )
    dataset.mkdir(parents=True, exist_ok=True)
    atomic_write_text(meta_path, json.dumps({"kind": what, "fingerprint": fingerprint,
                                             "created": time.time()}, indent=2, default=str))


def _make_progress(enabled: bool, console=None):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task) -> Text:  # type: ignore[override]
            speed = task.finished_speed or task.speed
            return Text("--/s" if speed is None else f"{speed:.1f}/s")

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(),
        TextColumn("elapsed"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
        disable=not enabled,
        console=console,
        transient=False,
    )


def _n_workers(client) -> int:
    with contextlib.suppress(Exception):
        return len(client.scheduler_info().get("workers", {}))
    return 0


def _failure_reason(client, exc: BaseException, dask_key: str,
                    backstop: Backstop | None = None) -> str:
    """A readable reason for a failed task attempt (timeout, worker death, exception)."""
    from distributed.scheduler import KilledWorker

    if isinstance(exc, KilledWorker):
        if backstop is not None and dask_key in backstop.restarted:
            return (f"timeout: worker unresponsive for {backstop.restarted[dask_key]:.0f} s "
                    "(restarted by the driver)")
        with contextlib.suppress(Exception):
            for _, msg in client.get_events(TIMEOUT_TOPIC):
                if isinstance(msg, dict) and msg.get("key") == dask_key:
                    return f"timeout: task exceeded {msg.get('timeout_s')} s (worker restarted)"
        return "worker process died (KilledWorker)"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:500]


class Backstop(threading.Thread):
    """Driver-side guard behind the in-task watchdog: restart a worker whose task of this
    campaign has been *processing* on it for more than ``limit_s`` seconds.

    The in-task watchdog cannot fire while native code holds the GIL (or if the worker's
    threads are wedged); this thread asks the worker's nanny for a restart instead. The
    task then fails with ``KilledWorker`` and goes through the normal retry/quarantine
    path with a timeout reason. ``limit_s`` should exceed the time a task may legitimately
    wait behind another one on the same worker (default in the campaign:
    ``2 * timeout_s + 30``).
    """

    def __init__(self, client, prefix: str, limit_s: float, interval_s: float = 5.0) -> None:
        super().__init__(name="convergent-backstop", daemon=True)
        self.client, self.prefix = client, prefix
        self.limit_s, self.interval_s = limit_s, interval_s
        self.first_seen: dict[str, float] = {}
        self.restarted: dict[str, float] = {}  # key -> seconds it had been processing
        self._halt = threading.Event()

    def check(self, now: float | None = None) -> list[str]:
        """One inspection; returns the workers it asked to restart."""
        now = time.monotonic() if now is None else now
        processing = self.client.processing()
        seen: set[str] = set()
        victims: list[str] = []
        for worker, keys in processing.items():
            for key in map(str, keys):
                if not key.startswith(self.prefix):
                    continue
                seen.add(key)
                age = now - self.first_seen.setdefault(key, now)
                if age > self.limit_s and worker not in victims:
                    victims.append(worker)
                    self.restarted[key] = age
        for key in list(self.first_seen):
            if key not in seen:
                del self.first_seen[key]
        if victims:
            with contextlib.suppress(Exception):
                self.client.restart_workers(victims, raise_for_error=False)
        return victims

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            with contextlib.suppress(Exception):
                self.check()

    def stop(self) -> None:
        self._halt.set()


class _Farm:
    """Bounded-in-flight task farm with retries, splitting and quarantine (driver side)."""

    def __init__(self, client, writer, quarantine: QuarantineLog, skip: set[str],
                 retries: int, tag: str, max_in_flight: int | None, flush_every_s: float,
                 summary: CampaignSummary, progress, bar, on_task: Callable | None) -> None:
        self.client, self.writer, self.qlog = client, writer, quarantine
        self.skip = skip  # keys already committed or quarantined
        self.retries, self.tag = retries, tag
        self.max_in_flight, self.flush_every_s = max_in_flight, flush_every_s
        self.s, self.progress, self.bar, self.on_task = summary, progress, bar, on_task
        self.pending_records = 0
        self.min_in_flight = 0  # e.g. 3 x adapt_max so an adaptive cluster sees the backlog
        self.backstop: Backstop | None = None

    def _limit(self) -> int:
        if self.max_in_flight:
            return self.max_in_flight
        return max(4, self.min_in_flight, 3 * max(1, _n_workers(self.client)))

    def run(self, tasks: list[Task]) -> None:
        from distributed import as_completed

        self.queue: deque[tuple[Task, int]] = deque((t, 0) for t in tasks)
        self.inflight: dict[Any, tuple[Task, int, str]] = {}
        self.ac = as_completed(with_results=True, raise_errors=False)
        self.limit = self._limit()
        t_start = time.perf_counter()
        self._submit()
        if self.backstop is not None:
            self.backstop.start()
        try:
            self._loop()
        finally:
            if self.backstop is not None:
                self.backstop.stop()
        if self.pending_records:
            self.writer.flush()
            self.pending_records = 0
        self.s.compute_wall_s = time.perf_counter() - t_start

    def _submit(self) -> None:
        """Top up the futures in flight (bounded, so the driver's memory stays small)."""
        while self.queue and len(self.inflight) < self.limit:
            task, attempt = self.queue.popleft()
            key = f"{self.tag}-{task.task_id}-a{attempt}"
            fut = self.client.submit(execute_task_packed, task, key, key=key, pure=False)
            self.inflight[fut] = (task, attempt, key)
            self.ac.add(fut)

    def _loop(self) -> None:
        last_flush = limit_t = time.monotonic()
        while self.inflight:
            fut, value = next(self.ac)
            task, attempt, key = self.inflight.pop(fut)
            if fut.status == "finished" and isinstance(value, bytes):
                value = pickle.loads(value)
            if fut.status == "finished" and isinstance(value, TaskResult):
                self._accept(task, value)
            else:
                exc = value
                if isinstance(value, tuple) and len(value) == 3:  # (type, exc, traceback)
                    exc = value[1]
                if not isinstance(exc, BaseException):
                    exc = RuntimeError(f"task ended with status {fut.status}")
                self._failed(task, attempt, key, exc, self.queue)
            fut.release()
            now = time.monotonic()
            if self.pending_records and now - last_flush >= self.flush_every_s:
                self.writer.flush()
                self.pending_records = 0
                last_flush = now
            if now - limit_t > 5.0:
                self.limit, limit_t = self._limit(), now
            self._submit()

    def _accept(self, task: Task, res: TaskResult) -> None:
        written = 0
        rejected = []
        for rec in res.records:
            if rec["key"] in self.skip:
                continue
            try:
                self.writer.write(rec)
            except DataError as exc:  # a record the store refuses: quarantine, go on
                rejected.append(_quarantine_entry(rec["key"], rec.get("molecule_id", ""),
                                                  f"record refused by the dataset: {exc}"))
                continue
            self.skip.add(rec["key"])
            written += 1
        q = [e for e in [*res.quarantined, *rejected] if e["key"] not in self.skip]
        self.qlog.append(q)
        for e in q:
            self.skip.add(e["key"])
            reason = e["reason"].split(":")[0][:60]
            self.s.reasons[reason] = self.s.reasons.get(reason, 0) + 1
        self.pending_records += written
        self.s.done += written
        self.s.quarantined += len(q)
        self.s.calc_s += res.calc_s
        self.s.n_calcs += res.n_calcs
        self.s.task_wall_s += res.wall_s
        self.s.tasks_run += 1
        self.progress.update(self.bar, advance=written + len(q), status=self._status())
        if self.on_task is not None:
            self.on_task(task, res, self.s)

    def _status(self) -> str:
        return f"retried {self.s.retried} quarantined {self.s.quarantined}"

    def _failed(self, task: Task, attempt: int, key: str, exc: BaseException,
                queue: deque) -> None:
        if attempt < self.retries:
            self.s.retried += 1
            queue.appendleft((task, attempt + 1))
            self.progress.update(self.bar, status=self._status())
            return
        if task.splittable and isinstance(task, FramesTask) and len(task.items) > 1:
            self.s.split += 1
            self.s.retried += 1
            for sub in reversed(task.split()):
                queue.appendleft((sub, self.retries))  # last chance each
            return
        reason = _failure_reason(self.client, exc, key, self.backstop)
        entries = [
            _quarantine_entry(k, task.molecule_of(k), reason, task=task.task_id,
                              attempts=attempt + 1)
            for k in task.keys if k not in self.skip
        ]
        self.qlog.append(entries)
        for e in entries:
            self.skip.add(e["key"])
        short = reason.split(":")[0][:60]
        self.s.reasons[short] = self.s.reasons.get(short, 0) + len(entries)
        self.s.quarantined += len(entries)
        self.progress.update(self.bar, advance=len(entries), status=self._status())


def _run_tasks(
    tasks: list[Task],
    dataset: Path,
    cluster: ClusterConfig,
    summary: CampaignSummary,
    *,
    retries: int,
    retry_quarantined: bool,
    max_in_flight: int | None,
    flush_every_s: float,
    tag: str,
    progress: bool,
    client=None,
    console=None,
    on_task: Callable | None = None,
    description: str = "simulate",
    backstop_s: float | None = None,
) -> CampaignSummary:
    """Resume bookkeeping + cluster + writer around :class:`_Farm`."""
    from convergent.cluster import dashboard_link, dask_client, describe_dashboard
    from convergent.data.writer import DatasetWriter

    qlog = QuarantineLog(dataset / QUARANTINE_NAME)
    committed = _existing_keys(dataset)
    quarantined = set() if retry_quarantined else qlog.keys()
    skip = committed | quarantined
    all_keys = [k for t in tasks for k in t.keys]
    summary.total_frames = len(all_keys)
    summary.tasks = len(tasks)
    summary.skipped = sum(1 for k in all_keys if k in skip)
    todo = [t for t in tasks if any(k not in skip for k in t.keys)]
    summary.dataset = str(dataset)
    summary.quarantine_file = str(qlog.path)
    if console is None:
        from rich.console import Console

        console = Console(stderr=True)
    echo = console.print if progress else None

    @contextlib.contextmanager
    def _client():
        if client is not None:
            yield client
        else:
            with dask_client(cluster, echo=echo) as c:
                yield c

    if not todo:
        if progress:
            console.print(f"{description}: all {summary.total_frames} frames already done "
                          f"({summary.skipped} skipped)")
        return summary
    bar_ctx = _make_progress(progress, console)
    with _client() as c, bar_ctx as prog:
        summary.n_workers = _n_workers(c)
        summary.dashboard = dashboard_link(c)
        if progress and client is not None:
            console.print(f"dask: {summary.n_workers} workers; dashboard: "
                          f"{describe_dashboard(summary.dashboard)}")
        bar = prog.add_task(description, total=summary.total_frames,
                            completed=summary.skipped, status="")
        with DatasetWriter(dataset, schema="molecular", append=True) as writer:
            farm = _Farm(c, writer, qlog, skip, retries, tag, max_in_flight, flush_every_s,
                         summary, prog, bar, on_task)
            if client is None and cluster.kind == "slurm":
                farm.min_in_flight = 3 * cluster.slurm.adapt_max
            if backstop_s:
                farm.backstop = Backstop(c, tag, backstop_s)
            farm.run(todo)
    return summary


def run_nonce() -> str:
    """A short random id so Dask keys of two runs of the same campaign never collide."""
    return os.urandom(3).hex()


def _finish(summary: CampaignSummary, t0: float) -> CampaignSummary:
    summary.wall_s = time.perf_counter() - t0
    summary.frames_per_s = summary.done / summary.wall_s if summary.wall_s > 0 else 0.0
    summary.mean_calc_s = summary.calc_s / summary.n_calcs if summary.n_calcs else 0.0
    return summary


def run_campaign(
    sim: SimulateConfig,
    cluster: ClusterConfig,
    dataset: Path,
    progress: bool = True,
    *,
    client=None,
    console=None,
    on_task: Callable[[Task, TaskResult, CampaignSummary], None] | None = None,
) -> CampaignSummary:
    """Run (or resume) a labelling campaign into the molecular dataset at ``dataset``.

    Args:
        sim: what to compute (source, sampler, calculator, chunking, timeouts, retries).
        cluster: where to run it (ignored when ``client`` is given).
        dataset: output dataset directory; re-running with the same ``sim`` resumes it.
        progress: show a rich progress bar (rate, ETA) and the dashboard address.
        client: an existing ``distributed.Client`` to use instead of starting a cluster.
        console: a rich Console for progress output (default: stderr).
        on_task: called on the driver after each task's results are handed to the writer.

    Returns a :class:`CampaignSummary`. Raises :class:`~convergent.errors.InputError` for a
    malformed input (unless ``sim.on_bad_input == "quarantine"``) and
    :class:`~convergent.errors.ConfigError` if ``dataset`` belongs to a different campaign.
    """
    t0 = time.perf_counter()
    dataset = Path(dataset)
    molecules, rejected = load_molecules(
        sim.source, sim.elements, sim.min_atoms, sim.max_atoms, sim.max_molecules, sim.seed,
        sim.on_bad_input,
    )
    fingerprint = campaign_fingerprint(sim)
    _check_fingerprint(dataset, fingerprint, "simulation campaign")
    summary = CampaignSummary()
    if rejected:
        _log_rejections(QuarantineLog(dataset / QUARANTINE_NAME), rejected)
        summary.input_rejected = len(rejected)
    tasks = plan_tasks(sim, molecules)
    tag = "sim-" + hashlib.blake2b(json.dumps(fingerprint, sort_keys=True, default=str).encode(),
                                   digest_size=4).hexdigest() + "-" + run_nonce()
    _run_tasks(tasks, dataset, cluster, summary, retries=sim.retries,
               retry_quarantined=sim.retry_quarantined, max_in_flight=sim.max_in_flight,
               flush_every_s=sim.flush_every_s, tag=tag, progress=progress, client=client,
               console=console, on_task=on_task,
               description=f"{sim.sampler} x {CalcSpec.from_simulate(sim).level}",
               backstop_s=2 * sim.timeout_s + 30 if sim.timeout_s > 0 else None)
    return _finish(summary, t0)


def _log_rejections(qlog: QuarantineLog, rejected: list[InputRejection]) -> None:
    known = qlog.keys()
    qlog.append(
        _quarantine_entry(f"input:{r.where}", "", r.reason, kind="InputError")
        for r in rejected if f"input:{r.where}" not in known
    )


def __getattr__(name: str):
    """``relabel`` and ``relabel_selection`` live in :mod:`convergent.sim.relabel`."""
    if name in ("relabel", "relabel_selection"):
        from convergent.sim import relabel as _rel

        return getattr(_rel, name)
    raise AttributeError(name)
