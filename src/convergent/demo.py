"""`convergent demo`: the converged loop end to end on small data, embedded defaults.

simulate (GFN2-xTB on a Dask LocalCluster) -> dataset store -> molecule-wise split ->
2-process torchrun DDP training -> screening of held-out molecules -> MD stability check
(Langevin with the surrogate: do molecules stay bonded?) -> each peer of ``demo.peers``
(e.g. MACE) trained, screened and MD-checked the same way -> report -> one short
active-learning round (the trained surrogate's committee picks what to label next).
Each stage records its summary in ``stages.json``; ``--resume`` skips finished stages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from convergent.config import ConvergentConfig
from convergent.core.errors import ConfigError, NotAvailableError
from convergent.core.fsutil import atomic_write_text, dumps_json
from convergent.monitor.accuracy import HeldoutPredictions
from convergent.monitor.comparison import ModelResult, console_lines, model_results, peer_stage
from convergent.monitor.report import PREDICTIONS, build_report
from convergent.runsdb.rundir import RunDir, open_run
from convergent.runsdb.trainrecords import TrainStep, read_train_records
from convergent.runsdb.usage import timed_stage

console = Console(stderr=True)

# The demo's own defaults, under any YAML file and --set (config.load_config's ``preset``):
# a force weight that leaves the energy room to be learned, and the steps to learn it.
# Chosen by measurement (held-out MAE against the per-element baseline; README.md, "How
# accurate is the demo"): on the demo's G2 data, force weight 10 -> 1 took the surrogate
# from 1.5x to 2.8x better than the baseline, 300 -> 500 steps to 3.4x.
# A peer MACE (``demo.peers: [mace]``) is small: 8 channels (8x0e+8x1o), body order 2,
# edge harmonics to l=2, a 16x16 radial MLP — about 5k parameters (ours: about 115k). On
# the 2-core development machine its 500 steps took about 1.7x ours' training time and its
# MD check 3x ours'. `--set model.mace.channels=32` etc. make it bigger.
DEMO_PRESET: dict[str, Any] = {
    "train": {"force_weight": 1.0, "steps": 500},
    "model": {"mace": {"channels": 8, "correlation": 2, "max_ell": 2, "radial_mlp": [16, 16]}},
}


def _stage(run: RunDir, name: str, fn, cfg: ConvergentConfig, *args: Any) -> dict[str, Any]:
    """Run one stage unless already done; record its wall time, resources and summary."""
    if run.is_done(name):
        console.print(f"[dim]{name}: already done, skipped (resume)[/dim]")
        return run.stages()[name]
    console.rule(f"[bold]{name}")
    summary = timed_stage(cfg, name, lambda: fn(cfg, *args))
    run.log_metrics({"kind": "stage", "stage": name, "wall_s": summary["wall_s"]})
    run.mark_done(name, summary)
    return summary


def simulate_stage(cfg: ConvergentConfig, run: RunDir) -> dict[str, Any]:
    """Label rattled configurations with the configured calculator on Dask."""
    from convergent.sim.campaign import run_campaign

    summary = run_campaign(cfg.simulate, cfg.cluster, run.data / "labels", progress=True)
    return summary.to_dict()


def split_stage(cfg: ConvergentConfig, run: RunDir) -> dict[str, Any]:
    """Split the labelled set by molecule (no molecule on both sides) into train/ and val/."""
    from convergent.data.reader import open_dataset, split_by_molecule
    from convergent.data.writer import write_subset

    ds = open_dataset(run.data / "labels")
    train_idx, val_idx = split_by_molecule(ds, cfg.data.val_fraction, cfg.data.seed)
    mols = ds.molecule_ids()
    out: dict[str, Any] = {}
    for name, idx in (("train", train_idx), ("val", val_idx)):
        write_subset(ds, idx, run.data / name, shard_bytes=cfg.data.shard_bytes,
                     compression=cfg.data.compression)
        out[f"{name}_frames"] = len(idx)
        out[f"{name}_molecules"] = len({mols[i] for i in idx})
    console.print(f"train: {out['train_frames']} frames of {out['train_molecules']} molecules; "
                  f"val: {out['val_frames']} frames of {out['val_molecules']} molecules")
    return out


def training_config(cfg: ConvergentConfig, run: RunDir) -> ConvergentConfig:
    """The demo's config with the dataset paths of this run filled in."""
    train = cfg.train.model_copy(update={"dataset": str(run.data / "train"),
                                         "val_dataset": str(run.data / "val")})
    return cfg.model_copy(update={"train": train})


def _train(cfg: ConvergentConfig, run: RunDir, label: str) -> Any:
    """Real torchrun DDP training of ``cfg`` in ``run``; the progress bar follows rank 0's
    metrics. Returns the launcher's ``TrainResult``."""
    from convergent.train.launch import launch_training

    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[loss]}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(label, total=cfg.train.steps, loss="")

        def follow(row: dict[str, Any]) -> None:
            if row.get("kind") == TrainStep.KIND:
                rec = TrainStep.from_dict(row)
                bar.update(task, completed=rec.step, loss=f"loss {rec.loss:.4g}")

        return launch_training(cfg, run, progress=follow)


def train_stage(cfg: ConvergentConfig, run: RunDir) -> dict[str, Any]:
    """Real torchrun DDP training; the progress bar follows rank 0's metrics."""
    result = _train(training_config(cfg, run), run, "train")
    _, vals = read_train_records(run.metrics)
    pl = result.placement
    out = {"steps": result.steps, "nproc": pl.nproc if pl else cfg.parallel.nproc,
           "strategy": cfg.parallel.strategy, "restarts": result.restarts,
           "device": pl.device if pl else None, "backend": pl.backend if pl else None,
           "gpu_names": pl.gpu_names if pl else [], "train_s": result.seconds}
    if vals:
        out.update(val_energy_mae=vals[-1].energy_mae, val_force_mae=vals[-1].force_mae)
    return out


def heldout_predictions(cfg: ConvergentConfig, run: RunDir, model_dir: Path) -> HeldoutPredictions:
    """``model_dir``'s predictions of the run's held-out molecules (``data/val``) beside
    the per-element linear baseline fitted on its training split (``data/train``)."""
    from convergent.screen.baseline import fit_on_dataset
    from convergent.screen.predict import predict_dataset

    res = predict_dataset([model_dir], run.data / "val", batch_atoms=cfg.screen.batch_atoms,
                          keep_atoms=True)
    base = fit_on_dataset(run.data / "train")
    starts = np.concatenate([[0], np.cumsum(res.n_atoms)])
    numbers = [res.numbers[starts[i]:starts[i + 1]] for i in range(len(res))]
    return HeldoutPredictions(
        n_atoms=res.n_atoms.tolist(), energy_true=res.energy_true.tolist(),
        energy_pred=res.energy_pred.tolist(), reference=cfg.simulate.method or cfg.simulate.calculator,
        keys=res.keys, molecule_ids=res.molecule_ids, baseline_pred=base.predict(numbers).tolist(),
        baseline_refs={str(z): e for z, e in base.energies.items()}, baseline_structures=base.structures,
        numbers=res.numbers.tolist(), forces_true=res.forces_true.tolist(),
        forces_pred=res.forces_pred.tolist(), force_mae=_finite(res.force_mae_total),
        seconds_per_structure=res.seconds_per_structure)


def count_parameters(model_dir: Path) -> int:
    """Parameters of an exported model (``models.io`` layout)."""
    from convergent.models.io import load_model

    model, _ = load_model(model_dir)
    return sum(p.numel() for p in model.parameters())


def screen_stage(cfg: ConvergentConfig, run: RunDir) -> dict[str, Any]:
    """Predict the held-out molecules with the trained surrogate and with the per-element
    linear baseline fitted on the training split; save both (``screen/predictions.json``)."""
    pred = heldout_predictions(cfg, run, run.ckpt / "final")
    pred.save(run.path / PREDICTIONS)
    acc = pred.summary()
    summary = {
        "structures": acc.structures,
        "energy_mae": acc.energy_mae,
        "energy_mae_per_atom": acc.energy_mae_per_atom,
        "baseline_energy_mae": acc.baseline_energy_mae,
        "baseline_energy_mae_per_atom": acc.baseline_energy_mae_per_atom,
        "baseline_over_model": acc.baseline_over_model,
        "force_mae": acc.force_mae,
        "seconds_per_structure": pred.seconds_per_structure,
        "model_kind": cfg.model.kind,
        "params": count_parameters(run.ckpt / "final"),
        "model_dir": str(run.ckpt / "final"),
    }
    console.print(f"held-out energy MAE: surrogate {_show(acc.energy_mae)} eV, per-element baseline "
                  f"{_show(acc.baseline_energy_mae)} eV (baseline / surrogate "
                  f"{_show(acc.baseline_over_model, '.2f')})")
    run.log_metrics({"kind": "screen", **summary})
    return summary


def _md_check(cfg: ConvergentConfig, model_dir: Path) -> Any:
    """The demo's MD check (``screen.md_check``) of the model in ``model_dir``."""
    from convergent.screen.mdcheck import md_check

    c = cfg.screen.md_check
    res = md_check(model_dir, tuple(c.molecules), c.seeds, c.temperature_K, c.time_fs,
                   c.timestep_fs, c.friction_per_fs)
    console.print(res.line())
    return res


def md_check_stage(cfg: ConvergentConfig, run: RunDir) -> dict[str, Any]:
    """Langevin MD with the trained surrogate: do molecules stay bonded?"""
    out = _md_check(cfg, run.ckpt / "final").to_dict()
    run.log_metrics({"kind": "md_check", "stable_runs": out["stable_runs"],
                     "total_runs": out["total_runs"]})
    return out


def peer_config(cfg: ConvergentConfig, run: RunDir, kind: str) -> tuple[ConvergentConfig, RunDir]:
    """The config of peer ``kind`` — the demo's, on the same split, with ``model.kind``
    set (its forces by autograd, as every peer kind's) — and its run directory
    ``peers/<kind>`` inside the demo's."""
    from convergent.models.config import ModelConfig

    pcfg = training_config(cfg, run)
    model = ModelConfig.model_validate({**pcfg.model.model_dump(), "kind": kind, "forces": "autograd"})
    return pcfg.model_copy(update={"model": model}), RunDir(run.path / "peers" / kind)


def peer_stage_fn(kind: str) -> Callable[[ConvergentConfig, RunDir], dict[str, Any]]:
    """The stage that trains peer ``kind`` as ours was trained (torchrun, the same split and
    training settings), screens it on the same held-out molecules against the same
    baseline and runs the same MD check; its summary is a :class:`ModelResult`."""

    def stage(cfg: ConvergentConfig, run: RunDir) -> dict[str, Any]:
        from convergent.config import save_config

        pcfg, prun = peer_config(cfg, run, kind)
        prun.path.mkdir(parents=True, exist_ok=True)
        save_config(pcfg, prun.config)  # `convergent report runs/<demo>/peers/<kind>` works
        trained = _train(pcfg, prun, kind)
        final = prun.ckpt / "final"
        pred = heldout_predictions(cfg, run, final)
        pred.save(prun.path / PREDICTIONS)
        acc = pred.summary()
        console.print(f"{kind} held-out energy MAE: {_show(acc.energy_mae)} eV, per-element baseline "
                      f"{_show(acc.baseline_energy_mae)} eV (baseline / {kind} "
                      f"{_show(acc.baseline_over_model, '.2f')})")
        mdc = _md_check(cfg, final)
        atomic_write_text(prun.path / "md_check.json", dumps_json(mdc.to_dict(), indent=2))
        res = ModelResult(
            name=kind, model_kind=kind, structures=acc.structures, energy_mae=acc.energy_mae,
            energy_mae_per_atom=acc.energy_mae_per_atom, baseline_energy_mae=acc.baseline_energy_mae,
            baseline_over_model=acc.baseline_over_model, force_mae=acc.force_mae,
            stable_runs=mdc.stable, total_runs=len(mdc.runs), params=count_parameters(final),
            steps=trained.steps, train_s=trained.seconds, model_dir=str(final))
        run.log_metrics(res.to_metric())
        return res.to_dict()

    return stage


def _summary(run: RunDir) -> None:
    """The console table of every trained model (only when a peer was trained)."""
    rows = model_results(run.stages())
    if len(rows) < 2:
        return
    console.rule("[bold]models on the held-out molecules")
    for line in console_lines(rows):
        console.print(line, soft_wrap=True, highlight=False, markup=False)


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def _show(x: float | None, spec: str = ".3f") -> str:
    return format(x, spec) if x is not None else "n/a"


def learn_config(cfg: ConvergentConfig, run: RunDir) -> ConvergentConfig:
    """One short active-learning round on the demo's data: the demo's training set is the
    labelled set, its model the warm start, its molecule source the pool."""
    from convergent.data.reader import open_dataset

    ds = open_dataset(run.data / "train")
    labelled = len(ds)
    ds.close()
    from convergent.learn.config import LEARN_PRESET

    L = cfg.learn
    learn = L.model_copy(update={
        "rounds": 1, "committee": 2, "seed": cfg.simulate.seed,
        "pool": L.pool.model_copy(update={"conformers": 2, "holdout_per_molecule": 1}),
        "label": L.label.model_copy(update={"init_dataset": str(run.data / "train"), "batch": 8,
                                            "budget": labelled + 8}),
        "members": L.members.model_copy(update={"init_model": str(run.ckpt / "final")}),
        "explore": L.explore.model_copy(update={"trajectories": 2, "steps": 20})})
    # members: 25 warm-started steps at learn's rate and batch (LEARN_PRESET), the demo's
    # force weight
    train = cfg.train.model_copy(update={"steps": 25, "lr": LEARN_PRESET["train"]["lr"],
                                         "batch_atoms": LEARN_PRESET["train"]["batch_atoms"]})
    return cfg.model_copy(update={"learn": learn, "train": train})


def learn_stage(cfg: ConvergentConfig, run: RunDir) -> dict[str, Any]:
    """One active-learning round on the shared Dask pool (convergent.learn)."""
    from convergent.learn.loop import run_learning

    lcfg = learn_config(cfg, run)
    summary = run_learning(lcfg, RunDir(run.path / "active_learning"))
    final = summary.get("final") or {}
    console.print(f"active learning report: {summary['report']}")
    return {"labels_added": summary["labels"] - (lcfg.learn.label.budget - lcfg.learn.label.batch),
            "rounds": summary["rounds"], "report": summary["report"],
            "heldout_energy_mae_per_atom": final.get("energy_mae_per_atom"),
            "heldout_force_mae": final.get("force_mae")}


def check_peers(cfg: ConvergentConfig) -> None:
    """``demo.peers``: each kind's package installed (found without importing it), not
    ours' own kind, and trainable with the demo's settings."""
    from convergent.models.mace import mace_installed
    from convergent.train.tasks import check_before_launch

    for kind in cfg.demo.peers:
        if kind == cfg.model.kind:
            raise ConfigError(f"demo.peers names {kind}, which is model.kind (ours) already",
                              hint=f"leave {kind} out of demo.peers, or set model.kind=molecular")
        if kind == "mace" and not mace_installed():
            raise NotAvailableError(
                "demo.peers names mace, which needs mace-torch (not installed)",
                hint="pip install 'convergent[mace]' (mace-torch), or leave mace out of demo.peers")
        model = cfg.model.model_copy(update={"kind": kind, "forces": "autograd"})
        check_before_launch(cfg.model_copy(update={"model": model}), data=False)


def check_inputs(cfg: ConvergentConfig) -> None:
    """What can fail before any work: the peers, the molecule source, the training shape."""
    from convergent.sim.sources import check_source
    from convergent.train.launch import plan_placement
    from convergent.train.tasks import check_before_launch

    check_peers(cfg)
    check_source(cfg.simulate.source, cfg.simulate.on_bad_input)
    check_before_launch(cfg, data=False)  # the datasets are made by the run itself
    plan_placement(cfg)  # more ranks than GPUs: refused before the run dir exists


def run_demo(cfg: ConvergentConfig, run_dir: str | Path | None = None, resume: bool = False) -> Path:
    """Run every stage of the converged loop; returns the report path."""
    t0 = time.perf_counter()
    run = open_run(cfg, run_dir, resume=resume, command="demo", check=lambda: check_inputs(cfg))
    console.print(f"run directory: [bold]{run.path}[/bold]")
    if cfg.tracking.mlflow:
        from convergent.tracking.store import open_tracking

        open_tracking(cfg, run.path)  # the MLflow run (params, code version) exists first
    _stage(run, "simulate", simulate_stage, cfg, run)
    _stage(run, "data", split_stage, cfg, run)
    _stage(run, "train", train_stage, cfg, run)
    _stage(run, "screen", screen_stage, cfg, run)
    _stage(run, "md_check", md_check_stage, cfg, run)
    for kind in cfg.demo.peers:
        _stage(run, peer_stage(kind), peer_stage_fn(kind), cfg, run)
    report = build_report(run.path)
    _stage(run, "learn", learn_stage, cfg, run)
    if cfg.tracking.mlflow:
        from convergent.tracking.finish import finish_run

        tracked = finish_run(cfg, run.path)
        console.print(f"mlflow: run {tracked['run_id']} in {tracked['uri']}"
                      f" (model version {tracked['model_version']})")
    _summary(run)
    console.rule("[bold]done")
    console.print(f"loop finished in {time.perf_counter() - t0:.0f} s")
    print(f"report: {report}")
    return report
