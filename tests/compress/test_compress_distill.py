"""Distillation: a committee's mean becomes the training targets of a smaller student,
trained by the real training engine and saved as a normal checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def test_teacher_labels_are_the_committee_mean_and_the_student_learns_them(tmp_path):
    from convergent.compress.distill import teacher_dataset
    from convergent.compress.qcheckpoint import load_surrogate
    from convergent.data.reader import open_dataset
    from convergent.models.batching import collate_records
    from convergent.models.config import ModelConfig
    from convergent.models.io import save_model
    from convergent.models.molecular import build_model, energy_and_forces
    from tests.train.moldataset import make_dataset
    from tests.train.trainhelpers import run_training

    train, val = make_dataset(tmp_path / "data", n_train=24, n_val=8)
    cfg = ModelConfig(hidden=32, layers=1, heads=4)
    teachers = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        teachers.append(save_model(build_model(cfg), cfg, tmp_path / f"teacher{seed}"))
    ts = teacher_dataset(teachers, train, tmp_path / "teacher-set", augment=1, sigma=0.05)
    assert ts.structures == 48 and ts.energy_std_mean > 0  # two different teachers
    ds = open_dataset(ts.path)
    recs = [ds[i] for i in range(len(ds))]
    ds.close()
    batch = collate_records(recs[:4])
    members = [load_surrogate(t) for t in teachers]
    outs = [energy_and_forces(m, batch, False) for m in members]
    mean_e = (outs[0][0] + outs[1][0]) / 2
    assert np.allclose([r["energy"] for r in recs[:4]], mean_e.numpy(), atol=1e-5)
    mean_f = ((outs[0][1] + outs[1][1]) / 2).numpy()
    assert np.allclose(np.concatenate([r["forces"] for r in recs[:4]]), mean_f, atol=1e-5)

    # the student: smaller, trained by the training engine on the teacher's targets
    overrides = [
        f"train.dataset={ts.path}", "train.device=cpu", "parallel.strategy=single",
        "model.hidden=16", "model.layers=1", "model.heads=2", "train.steps=25",
        "train.global_batch_atoms=96", "train.val_every=0", "train.lr=3e-3",
        "train.warmup_steps=2", "checkpoint.interval=0", "metrics.tensorboard=false",
    ]
    res, steps, _ = run_training(tmp_path, overrides, 1, "student")
    first = np.mean([r.loss for r in steps[:3]])
    last = np.mean([r.loss for r in steps[-3:]])
    assert last < first  # the loss to the teacher's outputs falls
    student = load_surrogate(res.final_dir)  # a normal checkpoint
    assert sum(p.numel() for p in student.parameters()) < sum(p.numel() for p in members[0].parameters())


def test_teacher_dataset_refuses_bad_input(tmp_path):
    from convergent.compress.distill import teacher_dataset
    from convergent.core.errors import InputError

    with pytest.raises(InputError, match="no teacher"):
        teacher_dataset([], tmp_path, tmp_path / "x")
    with pytest.raises(InputError, match="not a model directory"):
        teacher_dataset([tmp_path / "missing"], tmp_path, tmp_path / "x")
    assert not (tmp_path / "x").exists()
