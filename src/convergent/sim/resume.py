"""Resume: which records a dataset already holds, and whether it belongs to this campaign.

``<dataset>/campaign.json`` holds the fingerprint of the settings that determine the
records (not ``frames`` or chunking); re-running the same campaign on the same dataset
reads the committed keys and submits only tasks with missing keys, while a different
campaign on the same dataset is refused.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from convergent.core.errors import ConfigError, DataError
from convergent.core.fsutil import atomic_write_text, dumps_json
from convergent.data.manifest import manifest_path
from convergent.data.reader import Dataset, open_dataset
from convergent.sim.calculators import CalcSpec
from convergent.sim.config import SimulateConfig

CAMPAIGN_NAME = "campaign.json"


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
        keep += ["rattle_sigma", "distort_fraction", "dimer_fraction"]
    else:
        keep += ["temperatures", "md_timestep_fs", "md_friction", "md_interval", "md_warmup",
                 "md_frames"]
    out = {k: d[k] for k in keep}
    out["source_digest"] = _file_digest(sim.source)
    out["calculator"] = CalcSpec.from_simulate(sim).to_dict()
    return out


def open_existing(dataset: Path) -> Dataset | None:
    """The committed dataset at ``dataset``, opened once for a resume (None without a
    manifest yet): its keys say what is done, and the writer appends to the same handle."""
    if not manifest_path(dataset).is_file():
        return None
    return open_dataset(dataset)


def existing_keys(dataset: Path) -> set[str]:
    """Keys of the records committed to ``dataset`` (empty if it has no manifest yet)."""
    ds = open_existing(dataset)
    if ds is None:
        return set()
    try:
        return set(ds.keys())
    finally:
        ds.close()


def check_fingerprint(dataset: Path, fingerprint: dict[str, Any], what: str) -> None:
    """Write ``campaign.json`` on first use; refuse a dataset made by different settings."""
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
    if manifest_path(dataset).is_file():
        raise DataError(
            f"{dataset} is an existing dataset not written by a {what}",
            hint="choose another output path",
        )
    dataset.mkdir(parents=True, exist_ok=True)
    atomic_write_text(meta_path, dumps_json({"kind": what, "fingerprint": fingerprint,
                                             "created": time.time()}, indent=2, default=str))

