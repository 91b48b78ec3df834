"""`convergent data pack|inspect|verify|export|cache`: thin CLI over :mod:`convergent.data`."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from convergent.core.fsutil import dumps_json

data_app = typer.Typer(
    name="data",
    help="Dataset store: pack small files into shards, inspect, verify, export, cache; "
         "analytics on Dask: stats, dedup, filter, split, merge.",
    no_args_is_help=True,
)

_CONFIG = typer.Option(None, "--config", "-c", help="YAML config (its data section gives defaults).")
_SET = typer.Option(None, "--set", "-s", help="Override a config value: data.key=value (repeatable).")


def _data_config(config: Path | None, sets: list[str] | None):  # noqa: ANN202
    from convergent.cli.common import config_from_cli

    return config_from_cli(config, sets).data


@data_app.command("pack")
def pack(
    src: Path = typer.Argument(..., help="Directory tree of small files (any files, or xyz/extxyz), or one file."),
    out: Path | None = typer.Argument(None, help="Dataset directory to write (default DIR.dataset next to DIR)."),
    schema: str = typer.Option("auto", help="auto | bytes | molecular"),
    workers: int = typer.Option(0, min=0, help="Parallel parts on a local Dask cluster (0: one process)."),
    overwrite: bool = typer.Option(False, help="Replace an existing dataset at OUT."),
    config: Path | None = _CONFIG,
    sets: list[str] | None = _SET,
) -> None:
    """Turn a tree of many small files into a few checksummed shards."""
    from convergent.core.errors import InputError
    from convergent.data.pack import pack_directory

    cfg = _data_config(config, sets)
    if not src.exists():
        raise InputError(f"{src}: no such file or directory", hint="pass the directory (or file) to pack")
    if out is None:
        name = src.resolve().name
        out = src.parent / f"{src.resolve().stem if src.is_file() else name}.dataset"
    client = cluster = None
    if workers > 0:
        from dask.distributed import Client, LocalCluster

        # a bad input file fails its task; the driver reports it in one line, so the
        # workers' own "Compute Failed" tracebacks are silenced
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                               dashboard_address=None, silence_logs=logging.CRITICAL)
        client = Client(cluster)
    try:
        m = pack_directory(src, out, schema=schema, shard_bytes=cfg.shard_bytes,
                           compression=cfg.compression, overwrite=overwrite,
                           progress=True, workers=workers, client=client)
    finally:
        if client is not None:
            client.close()
            cluster.close()
    typer.echo(f"packed {m.records} records into {len(m.shards)} shards "
               f"({m.bytes / 2**20:.1f} MiB, schema {m.schema}) at {out}")


@data_app.command("inspect")
def inspect(
    path: Path = typer.Argument(..., help="Dataset directory."),
    sample: int | None = typer.Option(None, min=1, help="Decode at most N records for the element histogram."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Counts, sizes, schema, element histogram and energy statistics."""
    from convergent.data.inspect import inspect_dataset

    info = inspect_dataset(path, sample=sample)
    if as_json:
        typer.echo(dumps_json(info, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"dataset {path}", show_header=False)
    for k, v in info.items():
        if isinstance(v, dict):
            v = ", ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in v.items())
        t.add_row(k, str(v))
    Console().print(t)


@data_app.command("verify")
def verify(
    path: Path = typer.Argument(..., help="Dataset directory."),
    quick: bool = typer.Option(False, help="Checksums and layout only, skip record frames."),
    clean: bool = typer.Option(False, help="Delete stray temp files and orphan shards of interrupted writes."),
    min_age: float = typer.Option(3600.0, "--min-age", min=0.0,
                                  help="--clean only deletes leftovers untouched this many seconds."),
) -> None:
    """Check every shard checksum and record frame; exit 2 naming the first bad shard."""
    from rich.console import Console
    from rich.progress import Progress

    from convergent.core.errors import DataError
    from convergent.data.manifest import read_manifest
    from convergent.data.verify import clean_leftovers, verify_dataset

    n = len(read_manifest(path).shards)
    err = Console(stderr=True)
    with Progress(transient=True, console=err, disable=not err.is_terminal) as bar:
        task = bar.add_task("verifying", total=n)
        rep = verify_dataset(path, deep=not quick, on_shard=lambda _: bar.advance(task))
    if clean:
        removed, recent = clean_leftovers(path, min_age_s=min_age)
        for name in removed:
            typer.echo(f"removed: {name} (left by an interrupted write)")
        for name in recent:
            typer.echo(f"kept: {name} (modified less than {min_age:g} s ago: a writer may be using it)")
        rep.orphans = [o for o in rep.orphans if o not in removed]
        rep.temp_files = [t for t in rep.temp_files if t not in removed]
    for o in rep.orphans:
        typer.echo(f"note: {o} is not in the manifest (left by an interrupted write)")
    for t in rep.temp_files:
        typer.echo(f"note: {t} is a temporary file of an unfinished write "
                   "('convergent data verify --clean' removes it)")
    if not rep.ok:
        for p in rep.problems[1:]:
            typer.echo(f"also: {p}")
        more = f" (+{len(rep.problems) - 1} more problems listed on stdout)" if len(rep.problems) > 1 else ""
        raise DataError(rep.problems[0] + more, hint="restore the named shard(s) from a good copy")
    typer.echo(f"ok: {rep.shards} shards, {rep.records} records, {rep.bytes / 2**20:.1f} MiB verified")


@data_app.command("export")
def export(
    path: Path = typer.Argument(..., help="Dataset directory."),
    out: Path = typer.Argument(..., help="Output directory."),
    to: str = typer.Option(..., "--to", help="webdataset | mds"),
    shard_mib: int = typer.Option(128, min=1, help="Target shard size, MiB."),
) -> None:
    """Write the same data in a peer format (for the benchmarks)."""
    from convergent.data.export import export_dataset

    export_dataset(path, out, to, shard_bytes=shard_mib * 2**20)
    typer.echo(f"exported {path} to {out} as {to}")


@data_app.command("cache")
def cache(
    path: Path = typer.Argument(..., help="Dataset directory (the 'remote' copy)."),
    cache_dir: Path | None = typer.Option(None, "--dir", help="Node-local cache directory."),
    budget_gib: float | None = typer.Option(None, min=0.0, help="Byte budget, GiB."),
    warm: bool = typer.Option(False, help="Copy shards in (checked) until the budget is full."),
    clear: bool = typer.Option(False, help="Delete the cached copies (never an only copy)."),
    config: Path | None = _CONFIG,
    sets: list[str] | None = _SET,
) -> None:
    """Show, warm or clear the node-local cache of a dataset."""
    from convergent.core.errors import ConfigError
    from convergent.data.cache import ShardCache
    from convergent.data.reader import open_dataset

    cfg = _data_config(config, sets)
    directory = cache_dir or (Path(cfg.cache_dir) if cfg.cache_dir else None)
    if directory is None:
        raise ConfigError("no cache directory given", hint="pass --dir or set data.cache_dir")
    budget = int(budget_gib * 2**30) if budget_gib is not None else cfg.cache_bytes
    ds = open_dataset(path)  # a bad dataset fails before the cache directory is made
    c = ShardCache(directory, budget_bytes=budget)
    if clear:
        typer.echo(f"freed {c.clear() / 2**20:.1f} MiB")
    if warm:
        n = c.warm(ds)
        typer.echo(f"copied {n} shards (checksums verified)")
    cached = [s for s in ds.manifest.shards if c.local_path(s, ds.path).exists()]
    typer.echo(f"{len(cached)}/{len(ds.manifest.shards)} shards of {path} cached in {directory}; "
               f"cache uses {c.used_bytes() / 2**20:.1f} of {budget / 2**20:.1f} MiB")


def register(app: typer.Typer) -> None:
    """Add the `data` sub-commands to the root app."""
    from convergent.cli.data_analytics import register as register_analytics

    register_analytics(data_app)
    app.add_typer(data_app, name="data")
