"""Distilling the text Llama into a smaller one through the training engine
(``text.teacher``): the student's divergence from the teacher falls."""

from __future__ import annotations

import torch


def _kl(teacher, student, wins) -> float:
    with torch.no_grad():
        t = torch.log_softmax(teacher(wins[:, :-1]).float(), -1)
        s = torch.log_softmax(student(wins[:, :-1]).float(), -1)
    return float(torch.nn.functional.kl_div(s, t, log_target=True, reduction="batchmean"))


def test_student_distilled_from_teacher_gets_closer_to_it(tmp_path):
    from convergent.config import load_config
    from convergent.models.llama import load_pretrained
    from convergent.train.tasks import make_task
    from tests.train.trainhelpers import run_training

    base = [
        "text.source=stdlib", "text.max_files=24", "text.vocab_size=300",
        f"text.cache_dir={tmp_path / 'cache'}", "train.device=cpu", "model.kind=llama",
        "train.seq_len=32", "train.global_batch_seqs=8", "train.val_every=0",
        "train.val_max_batches=2", "train.warmup_steps=2", "train.lr=3e-3",
        "checkpoint.interval=0", "metrics.tensorboard=false", "parallel.strategy=single",
    ]
    res, _, _ = run_training(
        tmp_path, [*base, "model.hidden=32", "model.layers=2", "model.heads=2", "train.steps=30"],
        1, "teacher",
    )
    student_cfg = [*base, "model.hidden=16", "model.layers=1", "model.heads=2",
                   "train.steps=20", f"text.teacher={res.final_dir}"]
    res2, recs, run = run_training(tmp_path, student_cfg, 1, "student")
    teacher = load_pretrained(res.final_dir)
    student = load_pretrained(res2.final_dir)
    task = make_task(load_config(run.config, []))
    torch.manual_seed(0)  # the trainer's seed: the student's initialisation
    init = task.build_model().eval()
    wins = torch.cat([mb.data[0] for mb in task.val_batches(0, 1)])
    wins = torch.cat([wins, wins[:, -1:]], 1)
    assert _kl(teacher, student, wins) < 0.8 * _kl(teacher, init, wins)
    assert sum(p.numel() for p in student.parameters()) < sum(p.numel() for p in teacher.parameters())
    assert recs[-1].loss < recs[0].loss  # the reported loss is the student's own CE
