"""The committee's score, member by member: each member's predictions combined in the driver
equal the ensemble's (screen/predict.py on all members at once), and the pipelined
campaign's early score tasks are one per member and chunk."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def committee(tmp_path_factory):
    from convergent.config import ConvergentConfig
    from convergent.data.reader import open_dataset
    from convergent.learn.tasks import MemberJob, member_config, train_member
    from convergent.train.config import TrainConfig
    from tests.train.moldataset import make_dataset

    tmp = tmp_path_factory.mktemp("committee")
    train, _ = make_dataset(tmp / "data", n_train=20, n_val=4)
    base = ConvergentConfig.model_validate({"model": {"hidden": 16, "layers": 1, "heads": 2}})
    dirs = []
    for k in range(3):
        t = TrainConfig(dataset=str(train), steps=3, lr=1e-3, batch_atoms=256, seed=k)
        train_member(MemberJob(member_config(base, t), str(tmp / f"m{k}")))
        dirs.append(str(tmp / f"m{k}"))
    ds = open_dataset(train)
    recs = [ds[i] for i in range(len(ds))]
    ds.close()
    return dirs, recs


def test_members_combined_equal_the_ensemble(committee):
    from convergent.learn.tasks import _models, combine, member_predict
    from convergent.screen.predict import predict_records

    dirs, recs = committee
    ref = predict_records(_models(dirs, "cpu"), recs, 128, "cpu")
    parts = [member_predict(d, recs, 128, elements=[1, 6, 7, 8]) for d in dirs]
    got = combine(parts, recs, [1, 6, 7, 8])
    np.testing.assert_array_equal(got["energy_pred"], ref.energy_pred)
    np.testing.assert_array_equal(got["energy_std"], ref.energy_std)
    np.testing.assert_allclose(got["force_std_max"], ref.force_std_max, rtol=1e-12)
    assert got["features"].shape == (len(recs), 3 * 8 + 4)  # each member's, then 4 fractions
    one = combine(parts[:1], recs)
    assert np.isnan(one["energy_std"]).all() and np.isnan(one["force_std_max"]).all()


def test_member_scores_on_the_pool_one_task_per_member_and_chunk(committee, tmp_path):
    from convergent.cluster.pool import dask_client
    from convergent.learn.committee import MemberScores, joined
    from convergent.learn.engine import Pool, read_timeline
    from convergent.learn.tasks import score_records
    from convergent.sim.config import ClusterConfig

    dirs, recs = committee
    with dask_client(ClusterConfig(n_workers=2, dashboard_address=None)) as client:
        pool = Pool(client, tmp_path / "timeline.jsonl")
        ms = MemberScores(pool, 1, dirs, recs, 8, 128, [1, 6, 7, 8])
        ms.submit(1)  # as member 1 finishes training
        ms.submit(1)  # at most once
        head, tail = ms.collect(), MemberScores(pool, 1, dirs, [], 8, 128, None).collect()
    whole = score_records(dirs, recs, 128, elements=[1, 6, 7, 8])
    # chunks of 8 against one task of all: float32 batches of other sizes, the same numbers
    np.testing.assert_allclose(head["energy_std"], whole["energy_std"], rtol=1e-5)
    np.testing.assert_allclose(head["features"], np.asarray(whole["features"]), rtol=1e-5, atol=1e-6)
    assert tail == {} and joined([head, tail])["energy_pred"].shape == (len(recs),)
    names = sorted(s["name"] for s in read_timeline(tmp_path / "timeline.jsonl"))
    chunks = -(-len(recs) // 8)
    assert names == sorted(f"m{k}c{i * 8}" for k in range(3) for i in range(chunks))
