"""Multi-fidelity relabelling: recompute a seeded fraction of a dataset's frames at a higher
level of theory (e.g. PySCF B3LYP/6-31G* with density fitting) into a second dataset whose
records carry the same keys, for transfer learning.

>>> relabel(Path("data/xtb"), Path("data/dft"), RelabelConfig(fraction=0.05), ClusterConfig())

It runs on the same task farm as :func:`~convergent.sim.campaign.run_campaign` (retries,
timeouts, quarantine, streaming, idempotent resume).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from pathlib import Path

from convergent.cluster.config import ClusterConfig
from convergent.core.errors import ConfigError
from convergent.sim.calculators import CalcSpec
from convergent.sim.config import RelabelConfig
from convergent.sim.farm import run_nonce
from convergent.sim.molecules import stable_int
from convergent.sim.resume import check_fingerprint
from convergent.sim.runner import run_tasks
from convergent.sim.summary import CampaignSummary, finish
from convergent.sim.tasks import FrameItem, FramesTask, Task


def relabel_selection(keys: Iterable[str], fraction: float, seed: int) -> list[str]:
    """The keys chosen for relabelling: a seeded hash of each key below ``fraction``.

    Independent of dataset order and size, so growing the source keeps earlier choices.
    """
    cut = fraction * float(2**63)
    return [k for k in keys if stable_int("relabel", seed, k) < cut]


def relabel(
    source: Path,
    target: Path,
    rel: RelabelConfig,
    cluster: ClusterConfig,
    progress: bool = True,
    *,
    client=None,
    console=None,
    min_distance: float = 0.3,
    flush_every_s: float = 10.0,
) -> CampaignSummary:
    """Multi-fidelity: relabel a fraction of ``source``'s frames into ``target`` (same keys).

    ``rel`` is a :class:`~convergent.sim.config.RelabelConfig` (calculator, method, basis,
    density fitting, fraction, chunking, timeout, retries, seed). Resumable like
    :func:`run_campaign`.
    """
    from convergent.data.reader import open_dataset

    t0 = time.perf_counter()
    source, target = Path(source), Path(target)
    if source.resolve() == target.resolve():
        raise ConfigError("relabel: the target dataset must differ from the source")
    ds = open_dataset(source)
    spec = CalcSpec.from_relabel(rel)
    try:
        chosen = set(relabel_selection(ds.keys(), rel.fraction, rel.seed))
        items = []
        for i, key in enumerate(ds.keys()):
            if key not in chosen:
                continue
            r = ds[i]
            meta = {"relabel_of": {k: r["meta"].get(k) for k in ("program", "method")},
                    "source_energy": r["energy"]}
            for k in ("sampler", "temperature", "frame", "sigma", "step", "origin"):
                if k in r["meta"]:
                    meta[k] = r["meta"][k]
            items.append(FrameItem(key, r["molecule_id"], r["numbers"], r["positions"],
                                   int(r["charge"]), int(r["multiplicity"]), meta))
    finally:
        ds.close()
    # not the fraction: the selection only grows with it, so a larger fraction extends
    # the target dataset
    fingerprint = {"source": str(source.resolve()), "seed": rel.seed,
                   "calculator": spec.to_dict()}
    check_fingerprint(target, fingerprint, "relabel campaign")
    tasks: list[Task] = [
        FramesTask(f"x{c // rel.chunk_size:05d}", items[c:c + rel.chunk_size], spec,
                   min_distance, rel.timeout_s)
        for c in range(0, len(items), rel.chunk_size)
    ]
    summary = CampaignSummary()
    tag = "relabel-" + hashlib.blake2b(json.dumps(fingerprint, sort_keys=True).encode(),
                                       digest_size=4).hexdigest() + "-" + run_nonce()
    run_tasks(tasks, target, cluster, summary, retries=rel.retries, retry_quarantined=False,
              max_in_flight=None, flush_every_s=flush_every_s, tag=tag, progress=progress,
              client=client, console=console, description=f"relabel x {spec.level}",
              backstop_s=2 * rel.timeout_s + 30 if rel.timeout_s > 0 else None)
    return finish(summary, t0)
