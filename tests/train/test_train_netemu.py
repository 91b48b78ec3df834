"""A short DDP training job across the emulated 2 nodes x 2 ranks network (root only).

scripts/netemu.sh builds two network namespaces joined by a tbf-shaped veth pair
(addresses only inside them), the trainer runs one rank per process inside its node's
namespace, and the namespaces are removed afterwards, also when the job fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from bench.train.netemu import EmulatedNetwork, unavailable, wait_all  # noqa: E402
from convergent.runsdb.trainrecords import parse_train_records  # noqa: E402

REASON = unavailable()


@pytest.mark.skipif(REASON is not None, reason=f"emulated network: {REASON}")
def test_ddp_job_across_emulated_network(tmp_path: Path) -> None:
    from convergent.config import load_config
    from convergent.runsdb.rundir import open_run

    cfg = load_config(None, [
        "model.kind=llama", "model.hidden=64", "model.layers=2", "model.heads=4",
        "train.seq_len=32", "train.vocab_size=256", "train.global_batch_seqs=8",
        "train.steps=3", "train.val_every=0", "checkpoint.interval=0",
        "checkpoint.export_final=false", "metrics.tensorboard=false",
        "parallel.strategy=ddp", "parallel.allreduce=auto", "train.threads=1",
    ])
    run = open_run(cfg, tmp_path / "run")
    name = f"cvt{os.getpid() % 100000}"
    with EmulatedNetwork(name, "200mbit") as net:
        before = net.link_bytes(0)
        procs = net.spawn(
            [sys.executable, "-m", "convergent.train.main", "--config", str(run.config),
             "--run-dir", str(run.path)],
            [0, 0, 1, 1], port=29500 + os.getpid() % 1000, log_dir=tmp_path,
        )
        codes = wait_all(procs, timeout=240)
        after = net.link_bytes(0)
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-1500:] for r in range(4))
    assert codes == [0, 0, 0, 0], logs
    # the namespaces are gone again
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name not in listed
    recs = [json.loads(x) for x in run.metrics.read_text().splitlines()]
    plan = [r for r in recs if r.get("kind") == "comm_algorithm"]
    assert plan and plan[0]["allreduce"] == "hierarchical", plan
    assert plan[0]["nodes"] == [[0, 1], [2, 3]]
    steps, _ = parse_train_records(recs)
    assert len(steps) == 3
    # the gradient traffic crossed the shaped link: node A sent at least its two
    # ranks' slow-hop payloads of every step
    payload = sum(2 * r.comm_bytes for r in steps)
    assert payload > 0
    assert after["tx_bytes"] - before["tx_bytes"] >= payload
