"""The task farm (convergent.sim.taskfarm) on a real Dask cluster: the one retry rule,
what replaces a job out of retries, the timeline of every attempt, the device per kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from convergent.sim.taskfarm import Job, TaskFarm, next_attempt

distributed = pytest.importorskip("distributed")


def flaky(counter: str, fail_times: int, value: int) -> int:
    """Fails the first ``fail_times`` calls (counted in a file), then returns ``value``."""
    p = Path(counter)
    n = int(p.read_text()) if p.exists() else 0
    p.write_text(str(n + 1))
    if n < fail_times:
        raise RuntimeError(f"call {n} fails")
    return value


def where(device: str = "?") -> str:
    return device


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as c:
        yield c


def test_next_attempt_is_the_one_retry_rule():
    j = Job("k", "n", where)
    assert next_attempt(j, 0) is None
    again = next_attempt(j, 2)
    assert again.attempt == 1 and again.fn is where and next_attempt(again, 2).attempt == 2
    assert next_attempt(next_attempt(again, 2), 2) is None


def test_a_failing_job_is_retried_then_handed_back_and_every_attempt_is_recorded(client, tmp_path):
    timeline = tmp_path / "timeline.jsonl"
    farm = TaskFarm(client, timeline, {"work": 5})
    done, gave_up = [], []

    def on_done(job, value):
        done.append((job.name, job.attempt, value))
        return []

    def on_failed(job, exc):
        gave_up.append((job.name, job.attempt, str(exc)))
        # a replacement (a refill) for the job given up
        return [Job("work", "refill", flaky, (str(tmp_path / "c3"), 0, 30))]

    jobs = [Job("work", "twice", flaky, (str(tmp_path / "c1"), 2, 10)),  # ok on its 3rd run
            Job("work", "never", flaky, (str(tmp_path / "c2"), 99, 20))]  # out of retries
    farm.run(jobs, retries=2, on_done=on_done, on_failed=on_failed)
    assert sorted(done) == [("refill", 0, 30), ("twice", 2, 10)]
    assert gave_up == [("never", 2, "call 2 fails")]
    rows = [json.loads(line) for line in timeline.read_text().splitlines()]
    by = {}
    for r in rows:
        by.setdefault(r["key"].split("-a")[0], []).append((r["attempt"], r["failure"] is None))
    assert sorted(len(v) for v in by.values()) == [1, 3, 3]  # refill once, the others 3 times
    assert sorted(sum(ok for _, ok in v) for v in by.values()) == [0, 1, 1]
    assert all(r["kind"] == "work" for r in rows)


def test_on_failed_may_stop_the_run(client, tmp_path):
    farm = TaskFarm(client, None, {})

    def stop(job, exc):
        raise RuntimeError(f"{job.name} failed {job.attempt + 1} times")

    with pytest.raises(RuntimeError, match="bad failed 2 times"):
        farm.run([Job("work", "bad", flaky, (str(tmp_path / "c"), 99, 0))], retries=1,
                 on_done=lambda j, v: [], on_failed=stop)


def test_the_device_follows_the_kind(client):
    farm = TaskFarm(client, None, {"train": 40, "label": 40}, gpu_kinds=("train",), gpu=False)
    assert farm.result(farm.submit("train", "t", 1, where, device="x")) == "cpu"
    assert farm.device("train") == "cpu" and farm.device("label") == "cpu"
    assert TaskFarm(client, None, {}, gpu_kinds=("train",), gpu=True).device("train") == "cuda"


def worker_name(seconds: float = 0.0) -> str:
    import time

    time.sleep(seconds)
    return str(distributed.get_worker().name)


@pytest.fixture
def two_kinds():
    """A client whose scheduler has a worker with the resource CPU and one with GPU (the two
    job kinds of a Slurm pool with cluster.gpu, here in-process)."""
    with distributed.LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster, \
            distributed.Client(cluster) as c:
        async def start(name, resources):
            return await distributed.Worker(cluster.scheduler_address, nthreads=2, name=name,
                                            resources=resources, dashboard_address=":0")

        workers = [c.sync(start, "cpu-0", {"CPU": 2}), c.sync(start, "gpu-0", {"GPU": 1})]
        c.wait_for_workers(2)
        yield c
        for w in workers:
            c.sync(w.close)


def test_with_cpu_resource_each_kind_stays_on_its_workers(two_kinds):
    farm = TaskFarm(two_kinds, None, {"train": 1, "label": 1}, gpu_kinds=("train",), gpu=True,
                    cpu_resource=True)
    assert farm.resources("train") == {"GPU": 1} and farm.resources("label") == {"CPU": 1}
    got: dict[str, set[str]] = {"train": set(), "label": set()}

    def on_done(job, value):
        got[job.kind].add(value)
        return []

    jobs = [Job(kind, f"{kind}{i}", worker_name, (0.05,)) for kind in got for i in range(6)]
    farm.run(jobs, retries=0, on_done=on_done, on_failed=lambda j, e: [])
    assert got == {"train": {"gpu-0"}, "label": {"cpu-0"}}
    assert TaskFarm(two_kinds, None, {}).resources("label") is None  # a plain pool asks nothing


def test_abort_ends_a_wait_with_the_error(two_kinds):
    import threading

    from convergent.core.errors import ConfigError

    farm = TaskFarm(two_kinds, None, {}, gpu_kinds=("train",), gpu=True, cpu_resource=True)
    waiting = farm.submit("train", "slow", 0, worker_name, 3.0)
    threading.Timer(0.2, farm.abort, [ConfigError("no GPU job started")]).start()
    with pytest.raises(ConfigError, match="no GPU job started"):
        farm.result(waiting)
    with pytest.raises(ConfigError, match="no GPU job started"):  # and nothing more is sent
        farm.submit("label", "late", 0, worker_name)
