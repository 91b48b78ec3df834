"""`convergent runs list|show|compare|cost|rm`: the run directories under runs/."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from convergent.core.fsutil import dumps_json

ROOT_OPT = typer.Option(Path("runs"), "--root", help="Directory holding the runs.")
JSON_OPT = typer.Option(False, "--json", help="Print JSON (for scripts).")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _num(v: object) -> str:
    return format(v, ".4g") if isinstance(v, int | float) else "-"


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "-"


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def _metrics(m: dict[str, float]) -> str:
    keys = ("loss", "val_energy_mae", "val_force_mae", "screen_energy_mae")
    return " ".join(f"{k}={_num(m[k])}" for k in keys if k in m) or "-"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def _list(root: Path = ROOT_OPT, as_json: bool = JSON_OPT) -> None:
    """Every run: stages done (~ partial), start, duration, key metrics, size."""
    from convergent.runsdb.index import list_runs

    found = list_runs(root)
    if as_json:
        typer.echo(dumps_json([s.to_dict() for s in found], indent=1))
        return
    if not found:
        typer.echo(f"no runs under {root}")
        return
    rows = [["NAME", "STAGES", "START", "DURATION", "SIZE", "CODE", "METRICS"]]
    rows += [[s.name, s.status, _when(s.start), _dur(s.duration_s), _size(s.size_bytes),
              s.code, _metrics(s.metrics)] for s in found]
    typer.echo(_table(rows))


def _show(name: str = typer.Argument(..., help="Run name under --root, or a path."),
          root: Path = ROOT_OPT, as_json: bool = JSON_OPT) -> None:
    """One run: its summary, stages with timings, and metrics."""
    from convergent.runsdb.index import find_run, summarize

    run = find_run(name, root)
    s = summarize(run)
    stages = run.stages()
    if as_json:
        typer.echo(dumps_json({**s.to_dict(), "stage_records": stages}, indent=1))
        return
    typer.echo(f"run      {s.name}  ({s.path})")
    typer.echo(f"start    {_when(s.start)}   duration {_dur(s.duration_s)}   "
               f"size {_size(s.size_bytes)}   code {s.code}")
    typer.echo(f"stages   {s.status}")
    for stage, rec in stages.items():
        extra = ", ".join(f"{k}={_num(v)}" for k, v in rec.items()
                          if isinstance(v, int | float) and k not in ("finished_at", "wall_s"))
        typer.echo(f"  {stage:<9} {_dur(rec.get('wall_s'))}  {extra}")
    for k, v in s.metrics.items():
        typer.echo(f"  {k:<20} {_num(v)}")


def _compare(
    names: list[str] = typer.Argument(..., help="Two or more runs."),
    root: Path = ROOT_OPT,
    plot: Path | None = typer.Option(
        None, "--plot", help="PNG of the curves (default <root>/compare_<A>_<B>.png)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Config differences and metrics side by side; writes their loss/MAE curves."""
    from convergent.core.errors import ConfigError
    from convergent.runsdb.compare import compare_runs
    from convergent.runsdb.index import find_run

    if len(names) < 2:
        raise ConfigError("runs compare needs at least two runs", hint="runs compare A B")
    runs = [find_run(n, root) for n in names]
    out = plot or Path(root) / ("compare_" + "_".join(r.path.name for r in runs) + ".png")
    comp = compare_runs(runs, out)
    if as_json:
        typer.echo(dumps_json(comp.to_dict(), indent=1, default=str))
        return
    head = ["", *comp.names]
    typer.echo(_table([head, ["code", *comp.code]]) + "\n")
    typer.echo("config (differing keys)")
    rows = [head] + [[k, *(str(v) for v in vs)] for k, vs in comp.config.items()]
    typer.echo(_table(rows) if comp.config else "  (identical)")
    typer.echo("\nmetrics")
    typer.echo(_table([head] + [[k, *(_num(v) for v in vs)] for k, vs in comp.metrics.items()]))
    typer.echo(f"\nplot: {comp.plot}" if comp.plot else "\nplot: (no curves to plot)")


def _cost(names: list[str] = typer.Argument(None, help="Runs (default: all under --root)."),
          root: Path = ROOT_OPT, as_json: bool = JSON_OPT) -> None:
    """Core-seconds (and GPU-seconds) per stage and per run."""
    from convergent.runsdb.cost import run_cost
    from convergent.runsdb.index import find_run, list_runs

    runs = [find_run(n, root) for n in names] if names else [
        find_run(s.path) for s in list_runs(root)]
    costs = [run_cost(r) for r in runs]
    if as_json:
        typer.echo(dumps_json([c.to_dict() for c in costs], indent=1))
        return
    rows = [["RUN", "STAGE", "WALL_S", "CORES", "CORE_S", "GPU_S", "SOURCE"]]
    for c in costs:
        for st in c.by_stage().values():
            rows.append([c.name, st.stage, f"{st.wall_s:.1f}", _num(st.cores),
                         f"{st.core_s:.1f}", f"{st.gpu_s:.1f}", st.source])
        t = c.total()
        rows.append([c.name, "total", f"{t['wall_s']:.1f}", "", f"{t['core_s']:.1f}",
                     f"{t['gpu_s']:.1f}", ""])
    typer.echo(_table(rows))


def _rm(names: list[str] = typer.Argument(..., help="Runs to delete."),
        root: Path = ROOT_OPT,
        yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation.")
        ) -> None:
    """Delete run directories (asks first unless --yes)."""
    from convergent.runsdb.index import dir_size, find_run
    from convergent.runsdb.remove import remove_run

    runs = [find_run(n, root) for n in names]  # all must exist before any is removed
    for run in runs:
        if not yes and not typer.confirm(
                f"remove {run.path} ({_size(dir_size(run.path))})?", default=False):
            typer.echo(f"kept {run.path}")
            continue
        remove_run(run)
        typer.echo(f"removed {run.path}")


def register(app: typer.Typer) -> None:
    """Add the `runs` command group to the root app."""
    runs = typer.Typer(help="List, show, compare, cost and remove run directories.",
                       no_args_is_help=True)
    app.add_typer(runs, name="runs")
    runs.command("list")(_list)
    runs.command("show")(_show)
    runs.command("compare")(_compare)
    runs.command("cost")(_cost)
    runs.command("rm")(_rm)

