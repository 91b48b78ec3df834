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
