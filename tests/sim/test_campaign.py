"""The campaign on a real 2-worker LocalCluster with real tblite: streaming, resume,
quarantine, worker death, timeouts, MD, relabelling, CLI errors."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from convergent.cluster.config import ClusterConfig
from convergent.core.errors import ConfigError, DataError, InputError
from convergent.data.reader import open_dataset
from convergent.data.writer import DatasetWriter
from convergent.sim.campaign import (
    FramesTask,
    execute_task,
    plan_tasks,
    run_campaign,
)
from convergent.sim.config import RelabelConfig, SimulateConfig
from convergent.sim.relabel import relabel, relabel_selection
from convergent.sim.sources import load_molecules

SMALL = dict(max_atoms=5, chunk_size=10, flush_every_s=0.0)


def _records(path: Path) -> dict[str, dict]:
    ds = open_dataset(path)
    try:
        out = {}
        for rec in ds:
            assert rec["key"] not in out, f"duplicate record {rec['key']}"
            out[rec["key"]] = rec
        return out
    finally:
        ds.close()


def _expected_keys(sim: SimulateConfig) -> list[str]:
    mols, _ = load_molecules(sim.source, sim.elements, sim.min_atoms, sim.max_atoms,
                             sim.max_molecules, sim.seed)
    return [k for t in plan_tasks(sim, mols) for k in t.keys]


def _same_records(a: dict[str, dict], b: dict[str, dict]) -> None:
    assert a.keys() == b.keys()
    for k, ra in a.items():
        rb = b[k]
        assert ra["molecule_id"] == rb["molecule_id"]
        np.testing.assert_array_equal(ra["numbers"], rb["numbers"])
        np.testing.assert_array_equal(ra["positions"], rb["positions"])
        assert ra["energy"] == pytest.approx(rb["energy"], abs=1e-8)
        np.testing.assert_allclose(ra["forces"], rb["forces"], rtol=0, atol=1e-7)


def test_workers_are_single_threaded(sim_client):
    info = sim_client.scheduler_info()["workers"]
    assert len(info) == 2
    assert all(w["nthreads"] == 1 for w in info.values())
    env = sim_client.run(lambda: os.environ.get("OMP_NUM_THREADS"))
    assert set(env.values()) == {"1"}


def test_campaign_streams_records_and_resumes(sim_client, tmp_path):
    sim = SimulateConfig(frames=120, **SMALL)
    out = tmp_path / "ds"
    s = run_campaign(sim, ClusterConfig(), out, progress=False, client=sim_client)
    assert (s.done, s.quarantined, s.skipped) == (120, 0, 0)
    assert s.tasks == 12 and s.tasks_run == 12 and s.mean_calc_s > 0
    recs = _records(out)
    assert sorted(recs) == sorted(_expected_keys(sim))
    rec = recs["s0/g2-H2O/rattle/00001"]
    assert rec["molecule_id"] == "g2-H2O" and rec["positions"].shape == (3, 3)
    assert rec["forces"].shape == (3, 3) and rec["energy"] < -100
    meta = rec["meta"]
    assert meta["program"] == "tblite" and meta["method"] == "GFN2-xTB"
    assert {"version", "settings", "wall_s", "host", "sampler", "sigma"} <= set(meta)
    # the record equals an in-process calculation of the same frame
    mols, _ = load_molecules(sim.source, sim.elements, sim.min_atoms, sim.max_atoms)
    task = next(t for t in plan_tasks(sim, mols) if rec["key"] in t.keys)
    local = next(r for r in execute_task(task).records if r["key"] == rec["key"])
    np.testing.assert_array_equal(local["positions"], rec["positions"])
    assert local["energy"] == pytest.approx(rec["energy"], abs=1e-8)
    # the same campaign again computes nothing
    again = run_campaign(sim, ClusterConfig(), out, progress=False, client=sim_client)
    assert (again.done, again.skipped, again.tasks_run) == (0, 120, 0)
    # a larger campaign computes only the new frames
    more = run_campaign(sim.model_copy(update={"frames": 150}), ClusterConfig(), out,
                        progress=False, client=sim_client)
    assert (more.done, more.skipped) == (30, 120)
    assert len(_records(out)) == 150


def test_resume_reads_the_manifest_once(sim_client, tmp_path, monkeypatch):
    """Resume keys, the writer's append and its uniqueness check share one open dataset."""
    import convergent.data.reader as reader_mod
    import convergent.data.writer as writer_mod

    sim = SimulateConfig(frames=20, **SMALL)
    out = tmp_path / "ds"
    run_campaign(sim, ClusterConfig(), out, progress=False, client=sim_client)
    reads: list[Path] = []
    for mod in (reader_mod, writer_mod):
        real = mod.read_manifest

        def counted(path, _real=real):
            reads.append(Path(path))
            return _real(path)

        monkeypatch.setattr(mod, "read_manifest", counted)
    more = run_campaign(sim.model_copy(update={"frames": 40}), ClusterConfig(), out,
                        progress=False, client=sim_client)
    assert (more.done, more.skipped) == (20, 20)
    assert reads == [out]
    monkeypatch.undo()
    assert len(_records(out)) == 40
    # the uniqueness check still sees the committed keys through the shared handle
    ds = open_dataset(out)
    try:
        w = DatasetWriter(out, schema="molecular", append=True, existing=ds)
        with pytest.raises(DataError, match="duplicate"):
            w.write(next(iter(ds)))
        w.abort()
    finally:
        ds.close()


def test_different_campaign_on_same_dataset_is_refused(sim_client, tmp_path):
    out = tmp_path / "ds"
    sim = SimulateConfig(frames=10, **SMALL)
    run_campaign(sim, ClusterConfig(), out, progress=False, client=sim_client)
    with pytest.raises(ConfigError, match="rattle_sigma"):
        run_campaign(sim.model_copy(update={"rattle_sigma": 0.2}), ClusterConfig(), out,
                     progress=False, client=sim_client)


def test_bad_geometries_are_quarantined_not_fatal(sim_client, tmp_path):
    # O-H bonds (0.97 Å) are closer than 1.0 Å: every frame with one is a bad geometry.
    sim = SimulateConfig(frames=60, min_distance=1.0, rattle_sigma=0.01, **SMALL)
    out = tmp_path / "ds"
    s = run_campaign(sim, ClusterConfig(), out, progress=False, client=sim_client)
    assert s.quarantined > 0 and s.done > 0
    assert s.done + s.quarantined == 60
    q = [json.loads(line) for line in (out / "quarantine.jsonl").read_text().splitlines()]
    assert len(q) == s.quarantined
    assert all("bad geometry" in e["reason"] for e in q)
    qkeys = {e["key"] for e in q}
    assert "s0/g2-H2O/rattle/00000" in qkeys
    assert not qkeys & set(_records(out))
    # resuming does not retry quarantined frames (unless asked to)
    again = run_campaign(sim, ClusterConfig(), out, progress=False, client=sim_client)
    assert again.done == 0 and again.quarantined == 0 and again.skipped == 60


def test_md_campaign_labels_trajectories(sim_client, tmp_path):
    sim = SimulateConfig(sampler="md", temperatures=[300, 600], frames=12, md_frames=3,
                         md_interval=2, md_warmup=2, max_atoms=4, max_molecules=2,
                         flush_every_s=0.0)
    out = tmp_path / "md"
    s = run_campaign(sim, ClusterConfig(), out, progress=False, client=sim_client)
    assert s.done == 12 and s.quarantined == 0 and s.tasks == 4
    recs = _records(out)
    temps = {r["meta"]["temperature"] for r in recs.values()}
    assert temps == {300.0, 600.0}
    assert {r["meta"]["step"] for r in recs.values()} == {4, 6, 8}
    assert len({r["molecule_id"] for r in recs.values()}) == 2
    # a trajectory frame differs from its starting structure
    first = next(r for r in recs.values() if r["meta"]["frame"] == 0)
    mols, _ = load_molecules(sim.source, sim.elements, sim.min_atoms, sim.max_atoms,
                             sim.max_molecules)
    start = next(m for m in mols if m.molecule_id == first["molecule_id"])
    assert not np.allclose(start.positions, first["positions"])


def test_killed_worker_mid_campaign(sim_client, tmp_path):
    """SIGKILL one worker process while it runs a task: every frame ends done or
    quarantined, nothing lost, nothing duplicated."""
    sim = SimulateConfig(frames=200, max_atoms=6, chunk_size=10, flush_every_s=0.0)
    out = tmp_path / "ds"
    killed: list[int] = []

    def kill_busy_worker(task, result, summary):
        if killed or summary.tasks_run < 3:
            return
        busy = [w for w, keys in sim_client.processing().items() if keys]
        if not busy:
            return
        pid = sim_client.run(os.getpid, workers=[busy[0]])[busy[0]]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    s = run_campaign(sim, ClusterConfig(), out, progress=False, client=sim_client,
                     on_task=kill_busy_worker)
    assert killed, "no worker was killed"
    assert s.retried >= 1  # the task on the killed worker failed and was re-run
    assert s.done + s.quarantined == 200
    recs = _records(out)  # asserts no duplicate key
    q = (out / "quarantine.jsonl")
    qkeys = {json.loads(x)["key"] for x in q.read_text().splitlines()} if q.exists() else set()
    assert set(recs) | qkeys == set(_expected_keys(sim))
    assert not set(recs) & qkeys
    sim_client.wait_for_workers(2, timeout=120)  # the nanny restarted it


def test_timeout_kills_the_task_and_quarantines(sim_client, tmp_path):
    sim = SimulateConfig(sampler="md", frames=1, md_frames=1, md_interval=5000, md_warmup=0,
                         max_atoms=3, max_molecules=1, timeout_s=0.5, retries=0,
                         flush_every_s=0.0)
    out = tmp_path / "ds"
    s = run_campaign(sim, ClusterConfig(), out, progress=False, client=sim_client)
    assert s.done == 0 and s.quarantined == 1
    q = [json.loads(x) for x in (out / "quarantine.jsonl").read_text().splitlines()]
    assert all(e["reason"].startswith("timeout") for e in q), q
    sim_client.wait_for_workers(2, timeout=120)


_DRIVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from convergent.sim.campaign import run_campaign
    from convergent.cluster.config import ClusterConfig
    from convergent.sim.config import SimulateConfig

    def report(task, result, summary):
        print("TASK", task.task_id, summary.done, flush=True)

    if __name__ == "__main__":
        sim = SimulateConfig.model_validate_json(sys.argv[2])
        run_campaign(sim, ClusterConfig(n_workers=1), Path(sys.argv[1]), progress=False,
                     on_task=report)
        print("FINISHED", flush=True)
    """
)


def test_sigkill_driver_then_rerun(sim_client, tmp_path):
    """SIGKILL of the driver mid-campaign, then rerun: finished tasks are not recomputed
    and the dataset equals an uninterrupted run with the same seed."""
    sim = SimulateConfig(frames=200, max_atoms=5, chunk_size=10, flush_every_s=0.0, seed=3)
    out = tmp_path / "interrupted"
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out), sim.model_dump_json()],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    children = []
    try:
        seen = 0
        for line in proc.stdout:
            if line.startswith("TASK"):
                seen += 1
            if seen >= 5:
                children = psutil.Process(proc.pid).children(recursive=True)
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=60)
        # the driver's worker processes notice that it is gone and exit by themselves
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"orphaned worker processes: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
    assert proc.returncode == -signal.SIGKILL
    before = _records(out)
    assert 0 < len(before) < 200, "the driver was not killed mid-campaign"

    mols, _ = load_molecules(sim.source, sim.elements, sim.min_atoms, sim.max_atoms)
    tasks = {t.task_id: t for t in plan_tasks(sim, mols)}
    complete = {tid for tid, t in tasks.items() if set(t.keys) <= set(before)}
    assert complete
    ran: list[str] = []
    s = run_campaign(sim, ClusterConfig(), out, progress=False, client=sim_client,
                     on_task=lambda task, res, summ: ran.append(task.task_id))
    assert not complete & set(ran), "a finished task was recomputed"
    assert s.skipped == len(before) and s.done == 200 - len(before)

    ref = tmp_path / "uninterrupted"
    run_campaign(sim, ClusterConfig(), ref, progress=False, client=sim_client)
    _same_records(_records(out), _records(ref))


def test_invalid_inputs_error_or_quarantine(sim_client, tmp_path):
    f = tmp_path / "in.smi"
    f.write_text("CCO ethanol\nC1CC( broken\nCN methylamine\n")
    sim = SimulateConfig(source=f"smiles:{f}", frames=4, **SMALL | {"max_atoms": 12})
    with pytest.raises(InputError, match=r"in\.smi:2"):
        run_campaign(sim, ClusterConfig(), tmp_path / "a", progress=False, client=sim_client)
    sim = sim.model_copy(update={"on_bad_input": "quarantine"})
    s = run_campaign(sim, ClusterConfig(), tmp_path / "b", progress=False, client=sim_client)
    assert s.done == 4 and s.input_rejected == 1
    q = [json.loads(x) for x in (tmp_path / "b" / "quarantine.jsonl").read_text().splitlines()]
    assert q[0]["key"] == f"input:{f}:2" and "invalid SMILES" in q[0]["reason"]
    assert {r["molecule_id"] for r in _records(tmp_path / "b").values()} == {
        "smi-ethanol", "smi-methylamine"}


def test_cli_reports_malformed_extxyz(tmp_path, capsys):
    from convergent.cli import main

    f = tmp_path / "broken.extxyz"
    f.write_text("2\nProperties=species:S:1:pos:R:3\nH 0 0 0\nH 0 zero 0.7\n")
    code = main(["simulate", "--source", str(f), "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"error: {f}:4: malformed xyz/extxyz" in err
    assert "hint:" in err


def test_relabel_multi_fidelity_matching_keys(sim_client, tmp_path):
    sim = SimulateConfig(frames=12, elements=["H", "O"], max_atoms=3, **{
        k: v for k, v in SMALL.items() if k != "max_atoms"})
    src = tmp_path / "xtb"
    run_campaign(sim, ClusterConfig(), src, progress=False, client=sim_client)
    rel = RelabelConfig(fraction=0.5, method="HF", basis="sto-3g", density_fit=False,
                        chunk_size=2)
    s = relabel(src, tmp_path / "hf", rel, ClusterConfig(), progress=False, client=sim_client)
    low, high = _records(src), _records(tmp_path / "hf")
    chosen = relabel_selection(low, 0.5, 0)
    assert sorted(high) == sorted(chosen) and 0 < len(high) < 12
    assert s.done == len(high)
    for k, r in high.items():
        np.testing.assert_array_equal(r["positions"], low[k]["positions"])
        assert r["molecule_id"] == low[k]["molecule_id"]
        assert r["meta"]["program"] == "pyscf" and r["meta"]["method"] == "HF/sto-3g"
        assert r["meta"]["relabel_of"]["method"] == "GFN2-xTB"
        assert abs(r["energy"] - low[k]["energy"]) > 1.0  # another level of theory
    again = relabel(src, tmp_path / "hf", rel, ClusterConfig(), progress=False,
                    client=sim_client)
    assert again.done == 0 and again.skipped == len(high)
    # an SCF that cannot converge is quarantined with its reason; the campaign completes
    hopeless = rel.model_copy(update={"max_cycle": 1, "basis": "6-31G", "retries": 0})
    bad = relabel(src, tmp_path / "nc", hopeless, ClusterConfig(), progress=False,
                  client=sim_client)
    assert bad.done == 0 and bad.quarantined == len(high) and bad.retried == 0
    q = [json.loads(x) for x in (tmp_path / "nc" / "quarantine.jsonl").read_text().splitlines()]
    assert all("SCF not converged" in e["reason"] for e in q)


def test_frames_task_split_isolates_a_failing_frame():
    sim = SimulateConfig(frames=4, max_atoms=3, chunk_size=4)
    mols, _ = load_molecules(sim.source, sim.elements, sim.min_atoms, sim.max_atoms)
    task = plan_tasks(sim, mols)[0]
    assert isinstance(task, FramesTask)
    parts = task.split()
    assert [p.keys for p in parts] == [[k] for k in task.keys]
    assert not any(p.splittable for p in parts)


def _cli(args: list[str]) -> int:
    from convergent.cli import main

    return main(args)


def test_cli_simulate_into_run_dir(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["simulate", "--frames", "20", "--run-dir", str(run), "--set",
            "simulate.max_atoms=4", "--chunk-size", "5", "--workers", "1", "--no-progress"]
    assert _cli(args) == 0
    err = capsys.readouterr().err
    assert "simulate: done 20" in err and "frames/s" in err
    assert len(_records(run / "data" / "sim")) == 20
    stages = json.loads((run / "stages.json").read_text())
    assert stages["simulate"]["done"] == 20
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    per_task = [m for m in metrics if m["kind"] == "simulate.task"]
    assert len(per_task) == 4 and sum(m["frames"] for m in per_task) == 20
    assert any(m["kind"] == "simulate" and m["done"] == 20 for m in metrics)
    # the same command again is refused without --resume, and is a no-op with it
    assert _cli(args) == 2
    assert "--resume" in capsys.readouterr().err
    assert _cli([*args, "--resume"]) == 0
    assert "done 0, skipped 20" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_acceptance_md_5000_frames(tmp_path, capsys):
    """The issue's command: 5,000 MD frames of G2 at 300 and 600 K (a few minutes)."""
    out = tmp_path / "g2md"
    code = _cli(["simulate", "--source", "g2", "--sampler", "md", "--temperatures", "300,600",
                 "--frames", "5000", "--out", str(out), "--no-progress"])
    assert code == 0
    err = capsys.readouterr().err
    assert "simulate: done 5000" in err and "quarantined" in err and "frames/s" in err
    recs = _records(out)
    assert len(recs) == 5000
    assert {r["meta"]["temperature"] for r in recs.values()} == {300.0, 600.0}
    assert len({r["molecule_id"] for r in recs.values()}) > 50


def test_address_cluster_kind_connects_to_a_running_scheduler(sim_client, tmp_path, capsys):
    from rich.console import Console

    address = sim_client.scheduler.address
    sim = SimulateConfig(frames=10, **SMALL)
    console = Console(stderr=True, width=200)
    s = run_campaign(sim, ClusterConfig(kind="address", address=address), tmp_path / "ds",
                     progress=True, console=console)
    assert s.done == 10 and s.n_workers == 2
    err = capsys.readouterr().err
    assert f"dask: address cluster at {address}, 2 workers; dashboard: http://" in err
    assert "10/10" in err  # the progress bar


def _hold_the_gil() -> bool:
    import re

    # catastrophic backtracking: the regex engine never releases the GIL, so no Python
    # thread of this worker (the in-task watchdog included) can run until it is killed
    return re.match(r"(a+)+$", "a" * 64 + "b") is not None


def test_backstop_restarts_a_wedged_worker(sim_client):
    from distributed.scheduler import KilledWorker

    from convergent.sim.campaign import Backstop

    sim_client.wait_for_workers(2, timeout=120)
    fut = sim_client.submit(_hold_the_gil, key="bstest-wedged", pure=False)
    guard = Backstop(sim_client, "bstest-", limit_s=1.0)
    victims: list[str] = []
    deadline = time.monotonic() + 60
    while not victims and time.monotonic() < deadline:
        victims = guard.check()
        time.sleep(0.3)
    assert len(victims) == 1 and "bstest-wedged" in guard.restarted
    assert isinstance(fut.exception(timeout=120), KilledWorker)
    assert guard.restart_status == {victims[0]: "OK"}
    sim_client.wait_for_workers(2, timeout=120)
