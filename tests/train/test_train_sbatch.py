"""The sbatch script of `convergent train --submit` (no Slurm needed: rendering only)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from convergent.cli import main
from convergent.train.sbatch import SbatchJob, render


def test_script_is_valid_bash_with_the_job_options(tmp_path):
    job = SbatchJob(run_dir=tmp_path / "run", config_path=tmp_path / "run" / "config.yaml",
                    job_name="lm", nnodes=3, nproc=2, cpus_per_task=4, partition="gpu",
                    account="chem", time="02:00:00", requeue=True, signal_s=90,
                    extra_directives=["--qos=debug"], workdir=tmp_path)
    text = render(job)
    for line in ("#SBATCH --job-name=lm", "#SBATCH --nodes=3", "#SBATCH --cpus-per-task=4",
                 "#SBATCH --partition=gpu", "#SBATCH --account=chem", "#SBATCH --time=02:00:00",
                 "#SBATCH --requeue", "#SBATCH --signal=B:USR1@90", "#SBATCH --qos=debug",
                 f"#SBATCH --output={tmp_path}/run/logs/slurm-%j.out",
                 "export CONVERGENT_REQUEUE=1", "--nnodes=3 --nproc-per-node=2"):
        assert line in text, line
    script = tmp_path / "s.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    plain = render(SbatchJob(run_dir=Path("/r"), config_path=Path("/r/c.yaml"), job_name="x",
                             nnodes=1, nproc=1))
    assert "--requeue" not in plain and "CONVERGENT_REQUEUE" not in plain


def test_requeue_without_submit_is_refused(capsys):
    assert main(["train", "--requeue"]) == 2
    assert "--requeue needs --submit" in capsys.readouterr().err
