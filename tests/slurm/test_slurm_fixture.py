"""The fixture itself: two idle nodes, srun across both, clean teardown."""

from __future__ import annotations

import subprocess


def test_two_nodes_run_a_step_each(slurm):
    out = subprocess.run(["srun", "-N2", "-n2", "bash", "-c", "echo $SLURMD_NODENAME"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert sorted(out.split()) == ["n1", "n2"]

def test_hosts_lines_are_added_once(tmp_path, slurm):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.1.9 n2\n")
    slurm.add_hosts(hosts)
    slurm.add_hosts(hosts)
    lines = hosts.read_text().splitlines()
    assert sum(" n1 " in f" {ln} " for ln in lines) == 1
    assert sum(" n2 " in f" {ln} " for ln in lines) == 1  # the existing entry is kept


def test_nodes_declare_emulated_gpus(slurm):
    """Each node has gres gpu:2 (no GPU behind it); a --gres=gpu:1 step sees one of them."""
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %G"], capture_output=True, text=True,
                           timeout=30, check=True).stdout.split("\n")
    assert sorted(ln.split()[1] for ln in nodes if ln.strip()) == ["gpu:2", "gpu:2"]
    out = subprocess.run(["srun", "--gres=gpu:1", "bash", "-c",
                          "echo $SLURM_GPUS_ON_NODE $CUDA_VISIBLE_DEVICES"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["1", "0"]
