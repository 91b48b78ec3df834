"""`convergent data stats|dedup|filter|split|merge`: thin CLI over :mod:`convergent.analytics`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from convergent.core.fsutil import dumps_json

_CONFIG = typer.Option(None, "--config", "-c", help="YAML config (analytics, data and cluster sections).")
_SET = typer.Option(None, "--set", "-s", help="Override a config value, e.g. analytics.seed=3 (repeatable).")
_WORKERS = typer.Option(None, "--workers", "-w", min=1,
                        help="Local Dask workers (default: the cluster section: one per usable core).")
_SINGLE = typer.Option(False, "--single-process", help="Run the same tasks in this process, no Dask.")
_JSON = typer.Option(False, "--json", help="Print the result as JSON on stdout (for scripts).")
_OVERWRITE = typer.Option(False, "--overwrite", help="Replace an existing output dataset.")


@contextlib.contextmanager
def _engine(config: Path | None, sets: list[str] | None, workers: int | None, single: bool,
            quiet: bool) -> Iterator[tuple[Any, Any]]:
    from rich.console import Console

    from convergent.analytics.engine import Engine
    from convergent.cli.common import config_from_cli
    from convergent.cluster.pool import dask_client

    cfg = config_from_cli(config, sets)
    cache = cfg.data.cache_dir
    if single:
        yield cfg, Engine(client=None, progress=not quiet, cache_dir=cache)
        return
    ccfg = cfg.cluster
    if workers is not None:
        ccfg = ccfg.model_copy(update={"kind": "local", "n_workers": workers})
    echo = None if quiet else Console(stderr=True).print
    with dask_client(ccfg, echo=echo) as client:
        yield cfg, Engine(client=client, progress=not quiet, cache_dir=cache)


def _emit(result: dict[str, Any], as_json: bool, line: str) -> None:
    typer.echo(dumps_json(result, indent=1, default=str) if as_json else line)


def stats(
    path: Path = typer.Argument(..., help="Dataset directory."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Write stats.json + PNG histograms here "
                                    "(default DATASET.stats next to the dataset)."),
    run: Path | None = typer.Option(None, "--run", help="A run directory: write into its "
                                    "report/dataset, which `convergent report` includes."),
    workers: int | None = _WORKERS, single: bool = _SINGLE, as_json: bool = _JSON,
    config: Path | None = _CONFIG, sets: list[str] | None = _SET,
) -> None:
    """Dataset statistics: counts, distributions, label completeness (JSON + PNG).

    Counts per element/source/sampler/round, atoms per structure, energy-per-atom and
    force-norm quantiles and histograms, label completeness."""
    from convergent.analytics.stats import compute_stats, write_stats
    from convergent.core.errors import RunDirError
    from convergent.data.manifest import check_dataset

    check_dataset(path, "dataset")
    if run is not None and not (run / "config.yaml").is_file():
        raise RunDirError(f"--run {run}: not a run directory (no config.yaml)")
    with _engine(config, sets, workers, single, as_json) as (cfg, eng):
        st = compute_stats(path, eng, bins=cfg.analytics.histogram_bins)
    target = out or (run / "report" / "dataset" if run is not None else path.parent / f"{path.name}.stats")
    st["plots"] = write_stats(st, target)
    st["out"] = str(target)
    e, f = st["energy_per_atom"], st["force_norm"]
    _emit(st, as_json, f"{st['records']} records, {st['atoms']} atoms, elements "
          f"{', '.join(st['elements'])}; E/atom median {e.get('quantiles', {}).get('p50', float('nan')):.4g} eV, "
          f"|F| p99 {f.get('quantiles', {}).get('p99', float('nan')):.4g} eV/Å; "
          f"labels: energy {st['label_completeness']['energy']:.1%}, forces "
          f"{st['label_completeness']['forces']:.1%}; written to {target}")


def filter_(
    path: Path = typer.Argument(..., help="Input dataset."),
    out: Path = typer.Argument(..., help="Output dataset."),
    where: str = typer.Option(..., "--where", help="Boolean expression over record fields (see below)."),
    workers: int | None = _WORKERS, single: bool = _SINGLE, as_json: bool = _JSON,
    overwrite: bool = _OVERWRITE, config: Path | None = _CONFIG, sets: list[str] | None = _SET,
) -> None:
    """Keep the records for which --where is true."""
    from convergent.analytics.ops import filter_dataset
    from convergent.analytics.where import compile_where
    from convergent.data.manifest import check_dataset

    compile_where(where)
    check_dataset(path, "dataset")
    with _engine(config, sets, workers, single, as_json) as (cfg, eng):
        r = filter_dataset(path, out, where, eng, cfg.analytics.shard_bytes, overwrite)
    _emit(r, as_json, f"kept {r['kept']} of {r['read']} records ({r['dropped']} dropped) in {out}")


def dedup(
    path: Path = typer.Argument(..., help="Input dataset."),
    out: Path = typer.Argument(..., help="Output dataset (kept records + dropped.jsonl)."),
    tolerance: float | None = typer.Option(None, min=0.0, help="Near-duplicate tolerance on sorted "
                                           "interatomic distances, Å (default analytics.dedup_tolerance)."),
    workers: int | None = _WORKERS, single: bool = _SINGLE, as_json: bool = _JSON,
    overwrite: bool = _OVERWRITE, config: Path | None = _CONFIG, sets: list[str] | None = _SET,
) -> None:
    """Drop exact and near-duplicate structures; keep the first of each cluster.

    Exact: the same structure bit for bit. Near: the same composition and sorted
    interatomic distances per element pair within --tolerance Å."""
    from convergent.analytics.dedup import dedup_dataset
    from convergent.data.manifest import check_dataset

    check_dataset(path, "dataset")
    with _engine(config, sets, workers, single, as_json) as (cfg, eng):
        tol = cfg.analytics.dedup_tolerance if tolerance is None else tolerance
        r = dedup_dataset(path, out, tol, eng, cfg.analytics.shard_bytes,
                          cfg.analytics.partition_records, overwrite)
    _emit(r, as_json, f"kept {r['kept']} of {r['read']} records; dropped {r['dropped_exact']} exact and "
          f"{r['dropped_near']} near duplicates (tolerance {r['tolerance']:g} Å); table: {r['table']}")


def split(
    path: Path = typer.Argument(..., help="Input dataset."),
    out: Path = typer.Argument(..., help="Output directory: one dataset per split + split.json."),
    by: str | None = typer.Option(None, "--by", help="random | molecule | scaffold | composition "
                                  "(default analytics.split_by)."),
    splits: str | None = typer.Option(None, "--splits", help="NAME=SIZE,... fractions, record counts "
                                      "or one 'rest' (default analytics.splits)."),
    seed: int | None = typer.Option(None, min=0, help="Shuffle seed (default analytics.seed)."),
    workers: int | None = _WORKERS, single: bool = _SINGLE, as_json: bool = _JSON,
    overwrite: bool = _OVERWRITE, config: Path | None = _CONFIG, sets: list[str] | None = _SET,
) -> None:
    """Split into datasets (random, or whole molecules/scaffolds/compositions), seeded.

    Reports the leakage check: no molecule/scaffold/composition in two splits."""
    from convergent.analytics.split import MODES, parse_sizes, split_dataset
    from convergent.core.errors import InputError
    from convergent.data.manifest import check_dataset

    if by is not None and by not in MODES:
        raise InputError(f"--by {by!r}: unknown split mode", hint=f"use one of: {', '.join(MODES)}")
    if splits is not None:
        parse_sizes(splits)
    check_dataset(path, "dataset")
    with _engine(config, sets, workers, single, as_json) as (cfg, eng):
        a = cfg.analytics
        r = split_dataset(path, out, by or a.split_by, splits or a.splits,
                          a.seed if seed is None else seed, eng, a.shard_bytes, overwrite)
    sizes = ", ".join(f"{k} {v}" for k, v in r["records"].items())
    _emit(r, as_json, f"split by {r['by']} into {sizes} records at {out}; leakage check "
          f"{'passed' if r['leakage']['ok'] else 'FAILED'}: {r['leakage']}")


def merge(
    out: Path = typer.Argument(..., help="Output dataset."),
    inputs: list[Path] = typer.Argument(..., help="Input datasets."),
    prefix_keys: bool = typer.Option(False, help="Prefix keys with the input's number (when they clash)."),
    workers: int | None = _WORKERS, single: bool = _SINGLE, as_json: bool = _JSON,
    overwrite: bool = _OVERWRITE, config: Path | None = _CONFIG, sets: list[str] | None = _SET,
) -> None:
    """Merge datasets into one, re-sharded; the inputs are recorded in its lineage."""
    from convergent.analytics.ops import merge_datasets
    from convergent.data.manifest import check_dataset

    for k, p in enumerate(inputs):
        check_dataset(p, f"input {k + 1}")
    with _engine(config, sets, workers, single, as_json) as (cfg, eng):
        r = merge_datasets(inputs, out, eng, cfg.analytics.shard_bytes, prefix_keys=prefix_keys,
                           overwrite=overwrite)
    _emit(r, as_json, f"merged {len(inputs)} datasets: {r['records']} records in {r['shards']} shards at {out}")


def register(app: typer.Typer) -> None:
    """Add the analytics commands to ``convergent data``."""
    app.command("stats", epilog="Examples:\n\n  convergent data stats runs/demo/data/labels\n\n"
                 "  convergent data stats DS --out runs/demo/report/dataset --json | jq .force_norm")(stats)
    app.command("filter", epilog="Examples:\n\n  convergent data filter DS OUT --where \"max_force < 20 and n_atoms <= 30\"\n\n"
                 "  convergent data filter DS OUT --where \"abs(e_per_atom_z) < 4 and 'N' not in elements\"\n\n"
                 "Names: n_atoms energy e_per_atom e_per_atom_z max_force mean_force has_energy has_forces "
                 "charge multiplicity elements formula key molecule_id source sampler round meta.KEY")(filter_)
    app.command("dedup", epilog="Examples:\n\n  convergent data dedup DS OUT\n\n"
                 "  convergent data dedup DS OUT --tolerance 0   # exact duplicates only")(dedup)
    app.command("split", epilog="Examples:\n\n  convergent data split DS OUT --by scaffold --splits train=0.8,val=0.1,test=0.1\n\n"
                 "  convergent data split DS OUT --by random --splits val=500,test=500,train=rest --seed 1")(split)
    app.command("merge", epilog="Examples:\n\n  convergent data merge OUT run1/data/labels run2/data/labels\n\n"
                 "  convergent data merge OUT A B --prefix-keys   # keys become 0:k, 1:k")(merge)

