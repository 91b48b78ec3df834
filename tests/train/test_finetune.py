"""Fine-tuning and weight averaging as options of the one training loop (issue 38, item 1):
``train.init_from`` + ``init_reference``, ``freeze``, ``param_lr`` and ``ema_decay``, run
through train/fit.py (the Trainer of `convergent train`)."""

from __future__ import annotations

import numpy as np
import torch
from safetensors.numpy import load_file

from convergent.config import ConvergentConfig
from convergent.train.fit import fit
from tests.train.moldataset import make_dataset


def _cfg(data, **train):  # noqa: ANN001, ANN003
    base = {"dataset": str(data), "steps": 4, "lr": 1e-3, "batch_atoms": 128, "warmup_steps": 0,
            "threads": 1, "device": "cpu", "val_every": 0, "prefetch": 0, "force_weight": 1.0}
    return ConvergentConfig.model_validate({
        "model": {"hidden": 16, "layers": 2, "heads": 2}, "train": {**base, **train},
        "checkpoint": {"interval": 0, "keep": 1, "resume": False},
        "metrics": {"tensorboard": False, "mfu": False}})


def test_a_fine_tune_starts_from_the_warm_model_keeps_its_scale_and_its_frozen_weights(tmp_path):
    data, val = make_dataset(tmp_path / "data", n_train=24, n_val=8)
    fit(_cfg(data), tmp_path / "pre", export_to=tmp_path / "pre" / "model")
    pre = load_file(str(tmp_path / "pre" / "model" / "model.safetensors"))
    # "another level of theory": the val molecules, element offsets refitted, scale kept
    cfg = _cfg(val, init_from=str(tmp_path / "pre" / "model"), init_reference="offsets",
               freeze=["embedding.*", "layers.0.*"], param_lr={"energy_head.*": 1.0, "*": 0.3})
    fit(cfg, tmp_path / "ft", export_to=tmp_path / "ft" / "model")
    ft = load_file(str(tmp_path / "ft" / "model" / "model.safetensors"))
    for name in pre:
        if name.startswith(("embedding.", "layers.0.")):
            np.testing.assert_array_equal(ft[name], pre[name], err_msg=name)  # frozen
    moved = [n for n in pre if n.startswith(("layers.1.", "energy_head.")) and n in ft
             and not np.array_equal(ft[n], pre[n])]
    assert any(n.startswith("layers.1.") for n in moved) and any(n.startswith("energy_head.") for n in moved)
    assert ft["scale"] == pre["scale"] and ft["shift"] == pre["shift"]
    assert not np.array_equal(ft["atomref"], pre["atomref"])  # offsets refitted on the new data
    # "keep": the warm model's references as they were
    fit(_cfg(val, init_from=str(tmp_path / "pre" / "model"), init_reference="keep"),
        tmp_path / "keep", export_to=tmp_path / "keep" / "model")
    keep = load_file(str(tmp_path / "keep" / "model" / "model.safetensors"))
    np.testing.assert_array_equal(keep["atomref"], pre["atomref"])


def test_param_lr_groups_the_parameters_by_pattern_first_match_wins():
    from convergent.models.config import ModelConfig
    from convergent.models.molecular import build_model
    from convergent.train.runtime import param_groups

    m = build_model(ModelConfig(hidden=16, layers=2, heads=2))
    m.embedding.weight.requires_grad_(False)
    groups = param_groups(m, 1e-3, {"energy_head.*": 1.0, "*": 0.3})
    by_lr = {g["lr"]: {id(p) for p in g["params"]} for g in groups}
    head = {id(p) for n, p in m.named_parameters() if n.startswith("energy_head.")}
    assert by_lr[1e-3] == head
    assert id(m.embedding.weight) not in set().union(*by_lr.values())  # frozen: in no group
    assert len(by_lr[1e-3 * 0.3]) == sum(1 for n, p in m.named_parameters()
                                         if p.requires_grad and not n.startswith("energy_head."))
    (one,) = param_groups(m, 1e-3, {})
    assert [id(p) for p in one["params"]] == [id(p) for p in m.parameters() if p.requires_grad]


def test_the_weight_average_follows_its_formula_and_ends_the_run(tmp_path):
    from convergent.train.ema import WeightAverage

    lin = torch.nn.Linear(2, 1, bias=False)
    ema = WeightAverage([lin], decay=0.5)
    w0 = lin.weight.detach().clone()
    expect = w0.clone()
    for step, value in enumerate([1.0, 2.0, 3.0]):
        with torch.no_grad():
            lin.weight.fill_(value)
        ema.update(step)
        d = min(0.5, (1 + step) / (10 + step))
        expect = d * expect + (1 - d) * value
    ema.install()
    torch.testing.assert_close(lin.weight.detach(), expect)
    # in the loop: the exported model is the average, not the last step's weights
    data, _ = make_dataset(tmp_path / "data", n_train=24, n_val=4)
    fit(_cfg(data, steps=6), tmp_path / "raw", export_to=tmp_path / "raw" / "model")
    fit(_cfg(data, steps=6, ema_decay=0.9), tmp_path / "avg", export_to=tmp_path / "avg" / "model")
    raw = load_file(str(tmp_path / "raw" / "model" / "model.safetensors"))
    avg = load_file(str(tmp_path / "avg" / "model" / "model.safetensors"))
    assert any(not np.array_equal(raw[k], avg[k]) for k in raw if k.startswith("layers."))
