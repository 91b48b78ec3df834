"""Issue 38, item 1: one training loop. A committee member of `convergent learn` is a
`convergent train` run: with the same seed, data and settings, the member and the command
end with identical parameters (bit for bit), and a warm-started member continues from the
previous round's weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml
from safetensors.numpy import load_file


def _member_cfg(data: Path, seed: int, steps: int = 6, init: str | None = None) -> dict:
    from convergent.config import ConvergentConfig
    from convergent.learn.tasks import member_config
    from convergent.train.config import TrainConfig

    base = ConvergentConfig.model_validate({"model": {"hidden": 16, "layers": 1, "heads": 2}})
    train = TrainConfig(dataset=str(data), steps=steps, lr=2e-3, batch_atoms=128,
                        force_weight=1.0, seed=seed, init_from=init)
    return member_config(base, train)


def _weights(directory: Path) -> dict[str, np.ndarray]:
    return load_file(str(directory / "model.safetensors"))


def test_a_committee_member_is_a_convergent_train_run(tmp_path):
    from convergent.cli import main
    from convergent.learn.tasks import MemberJob, train_member
    from tests.train.moldataset import make_dataset

    data, _ = make_dataset(tmp_path / "data", n_train=24, n_val=4)
    cfg = _member_cfg(data, seed=11)
    summary = train_member(MemberJob(cfg, str(tmp_path / "member")))
    assert summary["steps"] == 6 and summary["records"] == 24

    # the command keeps its final checkpoint and exports from it (the member exports from
    # memory): the same settings otherwise, and the same weights
    command_cfg = {**cfg, "checkpoint": {**cfg["checkpoint"], "at_end": True}}
    (tmp_path / "member.yaml").write_text(yaml.safe_dump(command_cfg))
    run = tmp_path / "run"
    assert main(["train", str(tmp_path / "member.yaml"), "--nproc", "1",
                 "--run-dir", str(run)]) == 0
    member, command = _weights(tmp_path / "member"), _weights(run / "ckpt" / "final")
    assert member.keys() == command.keys()
    for name in member:
        np.testing.assert_array_equal(member[name], command[name], err_msg=name)
    # and training moved them: another seed ends elsewhere
    other = train_member(MemberJob(_member_cfg(data, seed=12), str(tmp_path / "other")))
    assert other["steps"] == 6
    assert any(not np.array_equal(member[k], _weights(tmp_path / "other")[k]) for k in member)


def test_a_warm_started_member_starts_from_the_previous_weights(tmp_path):
    from convergent.learn.tasks import MemberJob, train_member
    from tests.train.moldataset import make_dataset

    data, _ = make_dataset(tmp_path / "data", n_train=24, n_val=4)
    train_member(MemberJob(_member_cfg(data, seed=1), str(tmp_path / "r1")))
    # one step at a tiny learning rate from r1's weights stays next to them; from scratch
    # it would be at a fresh initialisation
    cfg = _member_cfg(data, seed=2, steps=1, init=str(tmp_path / "r1"))
    cfg["train"]["lr"] = 1e-9
    summary = train_member(MemberJob(cfg, str(tmp_path / "r2")))
    assert summary["warm_start"] is True
    a, b = _weights(tmp_path / "r1"), _weights(tmp_path / "r2")
    for name in a:
        if name not in ("atomref", "scale", "shift"):  # refitted on the data
            np.testing.assert_allclose(a[name], b[name], atol=1e-6, err_msg=name)
