"""The ``nci2k`` dataset: ~2,300 NCI compounds, conformers + xTB-MD frames, scaffold-grouped.

Compounds: the NCI SMILES shipped with RDKit (``first_5K.smi``) that parse, are one
neutral closed-shell fragment of H/C/N/O/F/S/Cl with 3..30 atoms including hydrogens,
deduplicated by canonical SMILES without stereo (2,324 with RDKit 2025.09), in a seeded
shuffled order (so the first chunks are a fair sample when only part is built).

Structures per compound: ``n_conf`` ETKDGv3 embeddings (own seeds) relaxed with MMFF94,
each labelled as is (MMFF geometry, off the xTB minimum), plus one short GFN2-xTB
Langevin trajectory per conformer (ASE Langevin with tblite, ``md_temperature`` K,
``md_timestep_fs``, ``md_warmup`` steps, then a frame every ``md_interval`` steps).

Built by convergent's simulation campaign (:func:`convergent.sim.campaign.run_campaign`,
the engine of ``convergent simulate``) on one Dask LocalCluster: compounds are cut into
chunks of ``chunk_compounds``; each chunk's conformers are written once to an extxyz file,
which two campaigns read as their source (``rattle`` with sigma 0 = the conformers
themselves; ``md``). A campaign resumes from the keys its dataset already holds, so a
killed build continues where it stopped; a chunk is complete when its ``done.json`` exists.
Everything lives under ``bench/data/nci2k_v1/`` (git-ignored). Energies eV, forces eV/Å.

    nice -n 19 .venv/bin/python -m bench.models.nci2k build [--chunks N]   # resumable
    nice -n 19 .venv/bin/python -m bench.models.nci2k status
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.models.molbench import DATA, nci_small, write_extxyz

ELEMENTS = ("H", "C", "N", "O", "F", "S", "Cl")


@dataclass(frozen=True)
class Nci2kSettings:
    """Everything that determines the dataset (a change needs a new ``root``)."""

    elements: tuple[str, ...] = ELEMENTS
    min_atoms: int = 3
    max_atoms: int = 30
    max_compounds: int | None = None  # None: every compound that passes the filter
    n_conf: int = 3
    md_temperature: float = 300.0
    md_timestep_fs: float = 1.0
    md_friction: float = 0.01  # 1/fs
    md_warmup: int = 10  # steps before the first saved frame
    md_interval: int = 20  # steps between saved frames (20 fs)
    md_frames: int = 3
    chunk_compounds: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("min_atoms", "max_atoms", "n_conf", "md_frames", "md_interval", "chunk_compounds"):
            if not 1 <= getattr(self, name) <= 10_000:
                raise ValueError(f"Nci2kSettings.{name} must be in 1..10000")
        if self.min_atoms > self.max_atoms or not 0 < self.md_temperature <= 5000:
            raise ValueError("Nci2kSettings: min_atoms <= max_atoms and 0 < md_temperature <= 5000")

    def describe(self) -> str:
        return (f"GFN2-xTB (tblite) on the NCI compounds shipped with RDKit (first_5K.smi): one "
                f"neutral closed-shell fragment of {'/'.join(self.elements)}, "
                f"{self.min_atoms}..{self.max_atoms} atoms incl. H, deduplicated by canonical "
                f"SMILES; {self.n_conf} ETKDGv3+MMFF94 conformers each (labelled as is) plus "
                f"{self.md_frames} Langevin xTB-MD frames per conformer ({self.md_temperature:g} K, "
                f"{self.md_timestep_fs:g} fs step, friction {self.md_friction:g}/fs, frames at "
                f"steps {self.md_warmup}+{self.md_interval}k, k=1..{self.md_frames}); built by convergent's "
                "simulation campaign on Dask")


@dataclass(frozen=True)
class Compound:
    cid: str  # nci2k-<index in the shuffled order>
    smiles: str  # canonical, no stereo
    scaffold: str  # Bemis-Murcko scaffold SMILES ('' = acyclic)


ROOT = DATA / "nci2k_v1"


@functools.lru_cache(maxsize=4)
def compounds(settings: Nci2kSettings = Nci2kSettings()) -> tuple[Compound, ...]:
    """The compounds that pass the filter, in the seeded shuffled build order."""
    from convergent.analytics.split import scaffold_of
    from convergent.sim.molecules import stable_int

    keep = nci_small(settings.max_atoms, settings.min_atoms, settings.elements, radicals=False)
    order = sorted(keep, key=lambda s: (stable_int("nci2k", settings.seed, s), s))
    if settings.max_compounds is not None:
        order = order[: settings.max_compounds]
    return tuple(Compound(f"nci2k-{i:04d}", s, scaffold_of({"meta": {"smiles": s}}))
                 for i, s in enumerate(order))


def scaffold_group(rec: dict[str, Any]) -> str:
    """The split group of a record: its Murcko scaffold, or ``acyclic:<molecule>`` (the
    rule of convergent.analytics.split: an acyclic molecule is its own group)."""
    return rec["scaffold"] or f"acyclic:{rec['molecule_id']}"


def group_folds(records: list[dict[str, Any]], group_of: Any, n_folds: int, fold: int,
                seed: int = 0) -> tuple[list[int], list[int]]:
    """Indices (train, test) of fold ``fold`` of a ``n_folds``-fold split by groups
    (``group_of(record)``, e.g. a Murcko scaffold): groups are shuffled with ``seed``, then
    dealt largest first to the fold with the fewest records, so no group is on both sides
    and folds hold about equal numbers of records."""
    if not 0 <= fold < n_folds:
        raise ValueError(f"fold {fold} outside 0..{n_folds - 1}")
    sizes: dict[str, int] = {}
    for r in records:
        g = group_of(r)
        sizes[g] = sizes.get(g, 0) + 1
    groups = sorted(sizes)
    np.random.default_rng(seed).shuffle(groups)
    groups.sort(key=lambda g: -sizes[g])  # stable: equal sizes keep the shuffled order
    load, where = [0] * n_folds, {}
    for g in groups:
        k = int(np.argmin(load))
        where[g] = k
        load[k] += sizes[g]
    te = [i for i, r in enumerate(records) if where[group_of(r)] == fold]
    tr = [i for i, r in enumerate(records) if where[group_of(r)] != fold]
    return tr, te


def balanced_scaffold_split(records: list[dict[str, Any]], fraction: float,
                            seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) indices of a balanced scaffold split (chemprop's
    ``scaffold_balanced``): scaffold groups larger than half the held-out target stay in
    training, the others are shuffled with ``seed`` and fill the held-out set up to
    ``fraction`` of the structures. Unlike :func:`group_folds`, whose largest-first deal
    puts nci2k's benzene group (about a quarter of it) alone in fold 0, the held-out set is
    many scaffolds."""
    members: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        members.setdefault(scaffold_group(r), []).append(i)
    target = fraction * len(records)
    small = sorted(g for g, idx in members.items() if len(idx) <= target / 2)
    held: list[int] = []
    for j in np.random.default_rng(seed).permutation(len(small)):
        if len(held) + len(members[small[j]]) <= target:
            held += members[small[j]]
    held_set = set(held)
    return [i for i in range(len(records)) if i not in held_set], sorted(held)


def split_report(records: list[dict[str, Any]], n_folds: int, seed: int = 0) -> dict[str, Any]:
    """Scaffold counts of ``records`` and of each fold of the scaffold-grouped split
    (:func:`group_folds` by :func:`scaffold_group`), with the groups on both sides (0)."""
    ring = {r["scaffold"] for r in records if r["scaffold"]}
    comps = {r["molecule_id"] for r in records}
    acyclic = {r["molecule_id"] for r in records if not r["scaffold"]}
    per_scaffold: dict[str, set[str]] = {}
    for r in records:
        per_scaffold.setdefault(scaffold_group(r), set()).add(r["molecule_id"])
    biggest = max(per_scaffold.items(), key=lambda kv: len(kv[1]))
    folds = []
    for k in range(n_folds):
        tr, te = group_folds(records, scaffold_group, n_folds, k, seed)
        gtr, gte = ({scaffold_group(records[i]) for i in idx} for idx in (tr, te))
        folds.append({"fold": k, "test_structures": len(te), "train_structures": len(tr),
                      "test_compounds": len({records[i]["molecule_id"] for i in te}),
                      "test_ring_scaffolds": len({g for g in gte if not g.startswith("acyclic:")}),
                      "test_acyclic_compounds": sum(g.startswith("acyclic:") for g in gte),
                      "scaffold_groups_in_train_and_test": len(gtr & gte)})
    return {"compounds": len(comps), "structures": len(records), "ring_scaffolds": len(ring),
            "acyclic_compounds": len(acyclic), "groups": len(per_scaffold),
            "largest_scaffold": {"scaffold": biggest[0], "compounds": len(biggest[1])},
            "rule": "Bemis-Murcko scaffold (RDKit, convergent.analytics.split.scaffold_of) of the "
                    "compound's SMILES; an acyclic compound is its own group",
            "folds": folds}


def _chunks(settings: Nci2kSettings) -> list[list[Compound]]:
    comps = compounds(settings)
    k = settings.chunk_compounds
    return [comps[i:i + k] for i in range(0, len(comps), k)]


def _write_conformers(path: Path, chunk: list[Compound], settings: Nci2kSettings) -> dict[str, str]:
    """The chunk's conformers as an extxyz (the campaigns' source); compounds RDKit cannot
    embed are left out and returned with the reason."""
    from ase import Atoms

    from convergent.sim.molecules import stable_int
    from convergent.sim.smiles import embed_smiles

    frames, failed = [], {}
    for comp in chunk:
        try:
            confs = [embed_smiles(comp.smiles, stable_int("nci2k-conf", settings.seed, comp.smiles, k))
                     for k in range(settings.n_conf)]
        except ValueError as exc:
            failed[comp.cid] = str(exc)
            continue
        for k, (numbers, pos, charge, mult) in enumerate(confs):
            a = Atoms(numbers=numbers, positions=pos)
            a.info.update(cid=comp.cid, smiles=comp.smiles, conformer=k, charge=charge,
                          multiplicity=mult)
            frames.append(a)
    write_extxyz(path, frames)
    return failed


def _sims(src: Path, n_frames: int, settings: Nci2kSettings) -> dict[str, Any]:
    """The two campaign configs of one chunk: conformers as is, and xTB-MD."""
    from convergent.sim.config import SimulateConfig

    common = dict(source=str(src), elements=[], min_atoms=1, max_atoms=settings.max_atoms,
                  calculator="xtb", method="GFN2-xTB", seed=settings.seed, flush_every_s=30.0)
    return {
        "conf": SimulateConfig(**common, sampler="rattle", rattle_sigma=0.0, frames=n_frames,
                               chunk_size=25),
        "md": SimulateConfig(**common, sampler="md", frames=n_frames * settings.md_frames,
                             temperatures=[settings.md_temperature],
                             md_timestep_fs=settings.md_timestep_fs, md_friction=settings.md_friction,
                             md_warmup=settings.md_warmup, md_interval=settings.md_interval,
                             md_frames=settings.md_frames),
    }


def _cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the Dask workers, once closed)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _workers_cpu_s(client: Any) -> float:
    """Summed CPU seconds of the Dask workers' processes so far (a worker restarted in
    between would make a per-chunk difference too small; the campaign reports restarts)."""
    return float(sum(client.run(time.process_time).values()))


def build(settings: Nci2kSettings = Nci2kSettings(), root: Path = ROOT, chunks: int | None = None,
          client: Any = None, progress: bool = True) -> dict[str, Any]:
    """Build (or resume) the first ``chunks`` chunks (None: all). Returns what was done;
    appends one line per chunk built to ``root/build.jsonl`` (wall s, campaign summary)."""
    from convergent.cluster.config import ClusterConfig
    from convergent.cluster.pool import dask_client
    from convergent.core.fsutil import atomic_write_text
    from convergent.sim.campaign import run_campaign

    all_chunks = _chunks(settings)
    todo = [c for c in range(len(all_chunks) if chunks is None else min(chunks, len(all_chunks)))
            if not (root / f"chunk{c:04d}" / "done.json").is_file()]
    root.mkdir(parents=True, exist_ok=True)
    settings_path = root / "settings.json"
    if settings_path.is_file() and json.loads(settings_path.read_text()) != json.loads(json.dumps(asdict(settings))):
        raise SystemExit(f"error: {root} was built with other settings ({settings_path}); use another root")
    atomic_write_text(settings_path, json.dumps(asdict(settings), indent=1))
    out = {"chunks_total": len(all_chunks), "built": [], "cpu_s": 0.0}
    if not todo:
        return out
    c0, w0 = _cpu_s(), time.perf_counter()

    def run(cl: Any) -> None:
        for c in todo:
            d = root / f"chunk{c:04d}"
            src = d / f"nci2k-c{c:04d}.extxyz"
            failed_path = d / "embed_failed.json"
            if not src.is_file():  # written once: the campaigns fingerprint its bytes
                d.mkdir(parents=True, exist_ok=True)
                failed = _write_conformers(src, all_chunks[c], settings)
                atomic_write_text(failed_path, json.dumps(failed, indent=1))
            import ase.io

            n = len(ase.io.read(src, index=":"))
            t, wc = time.perf_counter(), _workers_cpu_s(cl)
            summaries = {name: run_campaign(sim, ClusterConfig(), d / name, progress=progress,
                                            client=cl).to_dict()
                         for name, sim in _sims(src, n, settings).items()}
            line = {"chunk": c, "conformers": n, "wall_s": time.perf_counter() - t,
                    "workers_cpu_s": _workers_cpu_s(cl) - wc,
                    **{f"{k}_{f}": s[f] for k, s in summaries.items()
                       for f in ("done", "skipped", "quarantined", "calc_s", "n_calcs", "task_wall_s")}}
            atomic_write_text(d / "done.json", json.dumps(line, indent=1))
            with (root / "build.jsonl").open("a") as fh:
                fh.write(json.dumps({"time": time.time(), **line}) + "\n")
            out["built"].append(c)
            print(f"nci2k: chunk {c + 1}/{len(all_chunks)} done ({line['wall_s']:.0f} s wall)",
                  file=sys.stderr, flush=True)

    if client is not None:
        run(client)
    else:
        with dask_client(ClusterConfig()) as cl:
            run(cl)
    out["cpu_s"] = _cpu_s() - c0  # includes the workers' CPU (reaped) when we made the cluster
    out["wall_s"] = time.perf_counter() - w0
    return out


def load(settings: Nci2kSettings = Nci2kSettings(), root: Path = ROOT, chunks: int | None = None,
         build_missing: bool = True) -> list[dict[str, Any]]:
    """The records of the first ``chunks`` complete chunks (building missing ones first
    unless ``build_missing`` is False). ``molecule_id`` is the compound's canonical SMILES;
    each record also has ``scaffold``, ``kind`` ('conformer' | 'md') and ``conformer``."""
    import ase.io

    from convergent.data.reader import open_dataset

    if build_missing:
        build(settings, root, chunks)
    all_chunks = _chunks(settings)
    n = len(all_chunks) if chunks is None else min(chunks, len(all_chunks))
    scaffold = {comp.cid: comp.scaffold for ch in all_chunks for comp in ch}
    recs: list[dict[str, Any]] = []
    for c in range(n):
        d = root / f"chunk{c:04d}"
        if not (d / "done.json").is_file():
            continue
        src = ase.io.read(d / f"nci2k-c{c:04d}.extxyz", index=":")
        for kind, sub in (("conformer", "conf"), ("md", "md")):
            ds = open_dataset(d / sub)
            try:
                for r in ds:
                    a = src[int(r["molecule_id"].rsplit("-", 1)[1])]
                    recs.append({
                        "key": f"{a.info['cid']}/{r['key']}", "molecule_id": a.info["smiles"],
                        "cid": a.info["cid"], "scaffold": scaffold[a.info["cid"]], "kind": kind,
                        "conformer": int(a.info["conformer"]),
                        "numbers": np.asarray(r["numbers"], np.int64),
                        "positions": np.asarray(r["positions"], np.float64),
                        "energy": float(r["energy"]), "forces": np.asarray(r["forces"], np.float64),
                        "label_seconds": float((r.get("meta") or {}).get("wall_s", np.nan)),
                    })
            finally:
                ds.close()
    recs.sort(key=lambda r: r["key"])
    return recs


def status(settings: Nci2kSettings = Nci2kSettings(), root: Path = ROOT) -> dict[str, Any]:
    """How far the build is: chunks done, and the summed campaign numbers of build.jsonl."""
    chunks = _chunks(settings)
    done = [c for c in range(len(chunks)) if (root / f"chunk{c:04d}" / "done.json").is_file()]
    lines = [json.loads(x) for x in (root / "build.jsonl").read_text().splitlines()] if (root / "build.jsonl").is_file() else []
    return {"compounds_total": sum(map(len, chunks)), "chunks_total": len(chunks),
            "chunks_done": len(done), "compounds_done": sum(len(chunks[c]) for c in done),
            "build_lines": len(lines)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("build", "status"))
    ap.add_argument("--chunks", type=int, default=None, help="build only the first N chunks")
    args = ap.parse_args()
    if args.chunks is not None and args.chunks < 1:
        print("error: --chunks must be >= 1", file=sys.stderr)
        sys.exit(2)
    if args.action == "build":
        res = build(chunks=args.chunks)
        print(json.dumps({**res, **status()}))
    else:
        print(json.dumps(status()))


if __name__ == "__main__":
    main()
