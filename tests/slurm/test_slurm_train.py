"""`convergent train --submit` on the real Slurm fixture: the sbatch script, 2-node DDP,
HSDP groups from Slurm's node names, and preemption -> requeue -> exact resume."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

LM = [
    "model.kind=llama", "model.hidden=32", "model.layers=2", "model.heads=2",
    "train.seq_len=16", "train.vocab_size=64", "train.global_batch_seqs=8",
    "train.val_every=0", "train.warmup_steps=2", "train.lr=3e-3",
    "metrics.tensorboard=false", "checkpoint.export_final=false",
]


def _sets(overrides: list[str]) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def _submit(capsys, run: Path, overrides: list[str], *flags: str) -> str:
    from convergent.cli import main

    code = main(["train", "--submit", "--nnodes", "2", "--nproc", "1", "--run-dir", str(run),
                 *flags, *_sets(overrides)])
    out = capsys.readouterr().out
    assert code == 0, out
    m = re.search(r"submitted job (\d+)", out)
    assert m, out
    assert f"log: {run / 'logs' / ('slurm-' + m.group(1) + '.out')}" in out
    return m.group(1)


def _state(job_id: str) -> str:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"],
                         capture_output=True, text=True).stdout.strip()
    return out or "GONE"


def _wait_ended(job_id: str, run: Path, timeout_s: float = 300.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _state(job_id)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "GONE"):
            return state
        time.sleep(1.0)
    log = "\n".join(p.read_text()[-3000:] for p in (run / "logs").glob("slurm-*.out"))
    raise AssertionError(f"job {job_id} still {_state(job_id)} after {timeout_s} s:\n{log}")


def _completed(job: str, run: Path) -> None:
    state = _wait_ended(job, run)
    if state != "COMPLETED":
        logs = [run / "logs" / f"slurm-{job}.out", *sorted((run / "logs" / "train").glob("*.log"))]
        text = "\n".join(f"== {p}\n{p.read_text()[-4000:]}" for p in logs if p.exists())
        raise AssertionError(f"job {job} ended {state}:\n{text}")


def _records(run: Path, kind: str) -> list[dict]:
    """Records of a kind without a typed record (preemption, placement)."""
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == kind]


def _losses(run: Path) -> dict[int, float]:
    """The loss of each step, from its last train_step record."""
    from convergent.runsdb.trainrecords import read_train_records

    steps, _ = read_train_records(run / "metrics.jsonl", last_attempt=True)
    return {r.step: r.loss for r in steps}


def test_print_launch_shows_the_script_without_submitting(tmp_path, capsys, slurm):
    from convergent.cli import main

    run = tmp_path / "printed"
    assert main(["train", "--submit", "--print-launch", "--requeue", "--nnodes", "2",
                 "--run-dir", str(run), *_sets(LM)]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=2" in script and "#SBATCH --requeue" in script
    assert "#SBATCH --signal=B:USR1@60" in script and "--job-name=convergent-train-printed" in script
    assert f"--output={run}/logs/slurm-%j.out" in script and "srun " in script
    assert "torch.distributed.run" in script and not run.exists()


def test_ddp_on_two_nodes(tmp_path, capsys, slurm):
    run = tmp_path / "ddp"
    job = _submit(capsys, run, [*LM, "train.steps=12", "parallel.strategy=ddp"])
    _completed(job, run)
    result = json.loads((run / "logs" / "train_result.json").read_text())
    assert result["steps"] == 12 and result["world"] == 2
    (placement,) = _records(run, "train.placement")
    assert sorted(r["node"] for r in placement["ranks"]) == ["n1", "n2"]
    assert {r["slurm_job_id"] for r in placement["ranks"]} == {job}
    assert all(r["cpus"] for r in placement["ranks"])  # each rank's affinity is recorded
    assert (run / "train.sbatch").read_text().startswith("#!/bin/bash")
    # accounting: our own core-seconds and, after the job ended, Slurm's record of it
    from convergent.runsdb.accounting import collect_slurm, read_usage

    (own,) = [u for u in read_usage(run) if u.source == "self"]
    assert own.stage == "train" and own.job_id == job and own.cores == 2 and own.core_s > 0
    (charged,) = collect_slurm(run)
    assert charged.source == "slurm" and charged.job_id == job and charged.cores == 2
    assert charged.detail["via"] == "jobcomp" and charged.detail["nodes"] == "n[1-2]"
    assert collect_slurm(run) == []  # collected once


def test_hsdp_groups_follow_slurm_node_names(tmp_path, capsys, slurm):
    """Both emulated nodes are one host: grouping by host name would give one group."""
    run = tmp_path / "hsdp"
    job = _submit(capsys, run, [*LM, "train.steps=6", "parallel.strategy=hsdp"])
    _completed(job, run)
    (placement,) = _records(run, "train.placement")
    assert len({r["host"] for r in placement["ranks"]}) == 1
    assert placement["hsdp_groups"] == [[0], [1]]
    # torchrun's c10d rendezvous numbers the nodes in arrival order: rank 0 may be on n2
    assert sorted(placement["hsdp_group_nodes"]) == [["n1"], ["n2"]]
    node_of = {r["rank"]: r["node"] for r in placement["ranks"]}
    assert [[node_of[r] for r in g] for g in placement["hsdp_groups"]] == \
        placement["hsdp_group_nodes"]


def _wait_steps(run: Path, n: int, timeout_s: float = 180.0) -> None:
    from convergent.runsdb.trainrecords import read_train_records

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # wait (bounded) until training is under way
        if len(read_train_records(run / "metrics.jsonl")[0]) >= n:
            return
        time.sleep(0.2)


def _release_requeued(job: str) -> None:
    """A requeued job is held about two minutes (BeginTime); let it start at once."""
    deadline = time.monotonic() + 60
    while _state(job) != "PENDING" and time.monotonic() < deadline:
        time.sleep(0.5)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)


def test_preemption_warning_signal_requeues_through_the_script(tmp_path, capsys, slurm):
    """USR1 to the batch shell is what --signal=B:USR1@N delivers: the script's trap
    requeues the job, the ranks checkpoint on SIGTERM, the requeued job finishes."""
    steps = 120
    run = tmp_path / "usr1"
    job = _submit(capsys, run, [*LM, f"train.steps={steps}", "checkpoint.interval=1000"],
                  "--requeue")
    _wait_steps(run, 5)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    _release_requeued(job)
    _completed(job, run)
    log = next((run / "logs").glob("slurm-*.out")).read_text()
    assert "preemption warning: requeue" in log
    (pre,) = _records(run, "train.preempted")
    assert 0 < pre["step"] < steps
    losses = _losses(run)
    assert sorted(losses) == list(range(1, steps + 1))


def test_requeue_resumes_from_the_preemption_checkpoint(tmp_path, capsys, slurm):
    from tests.slurm.tests_slurm_reference import reference_losses

    steps = 200
    overrides = [*LM, f"train.steps={steps}", "parallel.strategy=ddp",
                 "checkpoint.interval=1000"]
    run = tmp_path / "requeue"
    job = _submit(capsys, run, overrides, "--requeue")
    _wait_steps(run, 5)
    subprocess.run(["scontrol", "requeue", job], check=True)
    _release_requeued(job)
    _completed(job, run)
    (pre,) = _records(run, "train.preempted")
    assert 0 < pre["step"] < steps and pre["signal"] in ("SIGTERM", "peer")
    placements = _records(run, "train.placement")
    assert [p["ranks"][0]["slurm_restart"] for p in placements] == [0, 1]
    result = json.loads((run / "logs" / "train_result.json").read_text())
    assert result["start_step"] == pre["step"] and result["steps"] == steps
    losses = _losses(run)
    assert sorted(losses) == list(range(1, steps + 1))
    # accounting: one own record per attempt, one Slurm record per run of the job
    from convergent.runsdb.accounting import collect_slurm, read_usage

    assert [u.detail["restart"] for u in read_usage(run) if u.source == "self"] == [0, 1]
    time.sleep(1.0)  # the jobcomp line of the last run is written as the job ends
    runs = collect_slurm(run)
    assert len(runs) == 2 and {u.job_id for u in runs} == {job}
    assert [u.detail["state"] for u in runs] == ["PENDING", "COMPLETED"]  # requeued, done
    assert losses == reference_losses(tmp_path / "reference", overrides)
