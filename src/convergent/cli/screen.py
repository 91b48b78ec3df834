"""`convergent screen`: predict a dataset with a model ensemble, pick the most uncertain."""

from __future__ import annotations

from pathlib import Path

import typer

from convergent.cli.common import CONFIG_ARG, SET_OPT, config_from_cli


def register(app: typer.Typer) -> None:
    """Add the `screen` command to the root app."""

    @app.command("screen")
    def _cmd(
        config: Path | None = CONFIG_ARG,
        sets: list[str] | None = SET_OPT,
        model: list[str] | None = typer.Option(
            None, "--model", "-m", help="Saved model directory; repeat for an ensemble."
        ),
        data: str | None = typer.Option(
            None, "--data", "-d", help="Dataset directory or structure file (extxyz, xyz...)."
        ),
        out: Path | None = typer.Option(None, "--out", "-o", help="Output directory."),
        select: int | None = typer.Option(None, "--select", "-k", min=0, help="How many to pick."),
        quantize: str | None = typer.Option(
            None, "--quantize", help="int8 (weight-only) or int8-dynamic; sets screen.quantize."
        ),
    ) -> None:
        """Predict energies/forces with a surrogate ensemble; select uncertain candidates."""
        from rich.console import Console

        from convergent.errors import ConfigError
        from convergent.resources import set_torch_threads, usable_cpus
        from convergent.screen.predict import predict_dataset

        cfg = config_from_cli(config, [*(sets or []), f"screen.quantize={quantize}"] if quantize else sets)
        sc = cfg.screen
        models = list(model or sc.models)
        dataset = data or sc.dataset
        if not models:
            raise ConfigError("no model to screen with", hint="pass --model DIR or set screen.models")
        if not dataset:
            raise ConfigError("no dataset to screen", hint="pass --data PATH or set screen.dataset")
        out_dir = out or Path(sc.output or Path(cfg.run.root) / (cfg.run.name or "screen"))
        k = sc.select if select is None else select
        set_torch_threads(usable_cpus())
        console = Console(stderr=True)
        with console.status(f"predicting {dataset} with {len(models)} model(s)"):
            result = predict_dataset(models, dataset, sc.batch_atoms, sc.device, quantize=sc.quantize)
        created = not out_dir.exists()
        try:
            _write(result, models, dataset, out_dir, k, sc, console)
        except BaseException:
            if created:  # a failed screen leaves no half-written output directory
                import shutil

                shutil.rmtree(out_dir, ignore_errors=True)
            raise


def _write(result, models, dataset, out_dir, k, sc, console) -> None:  # noqa: ANN001
    """Write predictions, the selection (ensembles) and summary.json into ``out_dir``."""
    from convergent.screen.select import fetch_records, select_uncertain, write_selection

    out_dir.mkdir(parents=True, exist_ok=True)
    result.save_jsonl(out_dir / "predictions.jsonl")
    summary = result.summary()
    if len(models) > 1 and k > 0:
        picked = select_uncertain(result, k, sc.select_by, sc.max_per_molecule)
        chosen = fetch_records(dataset, [int(result.indices[i]) for i in picked])
        write_selection(result, picked, chosen, out_dir, sc.select_by)
        summary["selected"] = len(picked)
    else:
        summary["selected"] = 0
        if k > 0:
            console.print("[yellow]one model: no uncertainty, nothing selected "
                          "(pass several --model for an ensemble)[/yellow]")
    import json

    from convergent.fsutil import atomic_write_text

    atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2))
    for key, val in summary.items():
        typer.echo(f"{key}: {val}")
    typer.echo(f"wrote {out_dir}")
