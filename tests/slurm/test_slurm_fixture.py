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
