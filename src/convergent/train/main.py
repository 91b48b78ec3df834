"""torchrun entry point: ``python -m convergent.train.main --config F --run-dir D``.

Initialises the process group (NCCL on CUDA, gloo on CPU), sets torch threads
(``train.threads``, default 1), logs to ``<run>/logs/train/rank<R>.log``, runs the
:class:`~convergent.train.trainer.Trainer`, and on rank 0 exports the final weights from
the last DCP checkpoint to ``<run>/ckpt/final`` and writes ``<run>/logs/train_result.json``.
Any exception is logged with its traceback in the rank's log before the process exits
non-zero (torchrun then stops the job, or restarts it under ``--max-restarts``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

from convergent.core.fsutil import dumps_json


def _setup_logging(run_path: Path, rank: int) -> None:
    logdir = run_path / "logs" / "train"
    logdir.mkdir(parents=True, exist_ok=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    handler = logging.FileHandler(logdir / f"rank{rank}.log")
    fmt = logging.Formatter(
        f"%(asctime)s rank{rank} attempt{attempt} %(levelname)s %(name)s: %(message)s"
    )
    handler.setFormatter(fmt)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(logging.Formatter("%(message)s"))
        logging.getLogger("convergent.train").addHandler(console)


def init_process_group(backend: str, timeout: timedelta) -> None:
    """``env://`` process group whose store keys are unique per elastic restart.

    After torchrun restarts the workers (``--max-restarts``), the agent's store still
    holds the previous attempt's gloo addresses; prefixing keys with the attempt number
    keeps the new workers from connecting to the dead ones.
    """
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"convergent/attempt{attempt}", store)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world, timeout=timeout
    )


def run(config_path: str, run_dir: str) -> dict:
    """Run training in this process (inside torchrun or alone); returns the summary."""
    import torch
    import torch.distributed as dist

    from convergent.cluster.resources import set_torch_threads
    from convergent.config import load_config
    from convergent.runsdb.rundir import RunDir
    from convergent.train.preempt import Preempted
    from convergent.train.trainer import Trainer

    t0 = time.time()
    cfg = load_config(config_path)
    run = RunDir(Path(run_dir))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _setup_logging(run.path, rank)
    log = logging.getLogger("convergent.train")
    set_torch_threads(cfg.train.threads)
    if world > 1 or "MASTER_ADDR" in os.environ:
        backend = cfg.parallel.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() and cfg.train.device != "cpu" else "gloo"
        init_process_group(backend, timedelta(minutes=10))
    try:
        trainer = Trainer(cfg, run)
        log.info(
            "strategy=%s world=%d device=%s dtype=%s start_step=%d",
            trainer.par.strategy, trainer.world, trainer.device, cfg.precision.dtype,
            trainer.start_step,
        )
        on_gpu = trainer.device.type == "cuda"
        try:
            summary = trainer.train()
        except Preempted as exc:
            log.warning("%s; the requeued job resumes from it", exc)
            _record_usage(run, cfg, world, rank, time.time() - t0, on_gpu, exc.step)
            return {"preempted_at": exc.step}
        last = summary["last_checkpoint"]
        task = trainer.task
        del trainer
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    if rank == 0:
        from convergent.core.fsutil import atomic_write_text

        if cfg.checkpoint.export_final and cfg.checkpoint.at_end:  # else: nothing saved
            from convergent.train.fit import export_final

            summary["final_dir"] = str(export_final(cfg, task, last, run.ckpt / "final"))
        atomic_write_text(run.logs / "train_result.json", dumps_json(summary, indent=2))
    _record_usage(run, cfg, world, rank, time.time() - t0, on_gpu, None)
    return summary


def _record_usage(run, cfg, world: int, rank: int, wall_s: float, on_gpu: bool,
                  preempted_at: int | None) -> None:
    """Rank 0 appends this attempt's own core/GPU-seconds to ``accounting.jsonl``."""
    if rank != 0:
        return
    from convergent.runsdb.accounting import Usage, append_usage

    cores = world * cfg.train.threads
    gpus = world if on_gpu else 0
    append_usage(run.path, [Usage(
        "train", "self", core_s=cores * wall_s, gpu_s=gpus * wall_s,
        job_id=os.environ.get("SLURM_JOB_ID"), wall_s=wall_s, cores=cores, gpus=gpus,
        detail={"restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                "preempted_at": preempted_at, "strategy": cfg.parallel.strategy})])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="convergent.train.main")
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args(argv)
    try:
        run(args.config, args.run_dir)
    except BaseException as exc:  # log every failure with its traceback, then re-raise
        logging.getLogger("convergent.train").error(
            "FAILED: %s\n%s", exc, traceback.format_exc()
        )
        from convergent.train.launch import write_rank_failure

        write_rank_failure(Path(args.run_dir), int(os.environ.get("RANK", "0")), exc)
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
