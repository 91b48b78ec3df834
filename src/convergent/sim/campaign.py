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
* **Stream.** Workers encode and compress their records in the dataset's shard format;
  the driver appends those bytes to :class:`~convergent.data.writer.DatasetWriter` as tasks
  complete (no file per calculation), so its core stays free for a worker. The writer is
  flushed (shard sealed, manifest committed) at most every ``flush_every_s`` seconds and
  at the end. Quarantined frames go to ``<dataset>/quarantine.jsonl`` (appended and
  fsynced per task).
* **Resume.** Re-running the same campaign on the same dataset reads the committed keys
  and the quarantine file and submits only tasks with missing keys; a recomputed task
  writes only its missing keys, so no record is ever duplicated. ``<dataset>/campaign.json``
  holds the fingerprint of the settings that determine the records; a different campaign
  on the same dataset is refused.

The pieces, one job each: :mod:`~convergent.sim.tasks` (units of work),
:mod:`~convergent.sim.plan` (keys and chunking), :mod:`~convergent.sim.worker` (running a
task), :mod:`~convergent.sim.guards` (timeouts), :mod:`~convergent.sim.farm` (the
driver's retry/quarantine loop), :mod:`~convergent.sim.runner` (resume bookkeeping,
cluster, writer, progress), :mod:`~convergent.sim.resume` (fingerprint, committed keys),
:mod:`~convergent.sim.quarantine` and :mod:`~convergent.sim.summary`. This module ties
them into :func:`run_campaign` and re-exports their public names.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

from convergent.cluster.config import ClusterConfig
from convergent.sim.calculators import CalcSpec
from convergent.sim.config import SimulateConfig
from convergent.sim.farm import run_nonce
from convergent.sim.guards import TIMEOUT_TOPIC, Backstop
from convergent.sim.plan import frame_key, plan_tasks
from convergent.sim.quarantine import QUARANTINE_NAME, QuarantineLog, log_rejections
from convergent.sim.resume import CAMPAIGN_NAME, campaign_fingerprint, check_fingerprint
from convergent.sim.runner import run_tasks
from convergent.sim.sources import load_molecules
from convergent.sim.summary import CampaignSummary, finish
from convergent.sim.tasks import FrameItem, FramesTask, MDTask, Task, TaskResult
from convergent.sim.worker import execute_task, execute_task_packed

__all__ = [
    "CAMPAIGN_NAME", "QUARANTINE_NAME", "TIMEOUT_TOPIC", "Backstop", "CampaignSummary",
    "FrameItem", "FramesTask", "MDTask", "QuarantineLog", "Task", "TaskResult",
    "campaign_fingerprint", "execute_task", "execute_task_packed", "frame_key",
    "plan_tasks", "run_campaign", "run_nonce",
]


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

    Returns a :class:`CampaignSummary`. Raises :class:`~convergent.core.errors.InputError` for a
    malformed input (unless ``sim.on_bad_input == "quarantine"``) and
    :class:`~convergent.core.errors.ConfigError` if ``dataset`` belongs to a different campaign.
    """
    t0 = time.perf_counter()
    dataset = Path(dataset)
    molecules, rejected = load_molecules(
        sim.source, sim.elements, sim.min_atoms, sim.max_atoms, sim.max_molecules, sim.seed,
        sim.on_bad_input,
    )
    fingerprint = campaign_fingerprint(sim)
    check_fingerprint(dataset, fingerprint, "simulation campaign")
    summary = CampaignSummary()
    if rejected:
        log_rejections(QuarantineLog(dataset / QUARANTINE_NAME), rejected)
        summary.input_rejected = len(rejected)
    tasks = plan_tasks(sim, molecules)
    tag = "sim-" + hashlib.blake2b(json.dumps(fingerprint, sort_keys=True, default=str).encode(),
                                   digest_size=4).hexdigest() + "-" + run_nonce()
    run_tasks(tasks, dataset, cluster, summary, retries=sim.retries,
              retry_quarantined=sim.retry_quarantined, max_in_flight=sim.max_in_flight,
              flush_every_s=sim.flush_every_s, tag=tag, progress=progress, client=client,
              console=console, on_task=on_task,
              description=f"{sim.sampler} x {CalcSpec.from_simulate(sim).level}",
              backstop_s=2 * sim.timeout_s + 30 if sim.timeout_s > 0 else None)
    return finish(summary, t0)
