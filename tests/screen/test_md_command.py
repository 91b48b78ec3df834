"""`convergent md` end to end: a saved model, the G2 source filtered by the model's
elements, every run in one batch, md.json and trajectories.extxyz; bad input is one line."""

from __future__ import annotations

import json

import torch

from convergent.cli import main


def _model(tmp_path):
    from convergent.models.config import ModelConfig
    from convergent.models.io import save_model
    from convergent.models.molecular import ReferenceEnergies, build_model

    torch.manual_seed(0)
    cfg = ModelConfig(hidden=16, layers=1, heads=2)
    m = build_model(cfg)
    m.set_reference(ReferenceEnergies({1: -10.0, 6: -40.0, 8: -70.0}))  # an H/C/O model
    return save_model(m.eval(), cfg, tmp_path / "model")


def test_md_command_writes_every_run_and_frame(tmp_path, capsys):
    from ase.io import read

    model = _model(tmp_path)
    out = tmp_path / "md"
    code = main(["md", "-m", str(model), "--source", "g2", "--max-molecules", "6", "--seeds", "2",
                 "--time-fs", "10", "--every", "5", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    res = json.loads((out / "md.json").read_text())
    runs = res["runs"]
    assert res["total_runs"] == len(runs) == 12 and {r["seed"] for r in runs} == {0, 1}
    assert 0.0 <= res["stable_fraction"] <= 1.0
    frames = read(out / "trajectories.extxyz", index=":")
    # only H/C/O molecules were taken (G2 has N, F, Cl, ... molecules the model never saw)
    assert {int(z) for a in frames for z in a.numbers} <= {1, 6, 8}
    firsts = [a for a in frames if a.info["step"] == 0]
    assert len(firsts) == 12 and {(a.info["molecule"], a.info["seed"]) for a in firsts} == {
        (r["molecule"], r["seed"]) for r in runs}
    # a stable run has its start and 4 kept frames (20 steps, every 5)
    stable = {(r["molecule"], r["seed"]) for r in runs if r["stable"]}
    for key in stable:
        assert sorted(a.info["step"] for a in frames
                      if (a.info["molecule"], a.info["seed"]) == key) == [0, 5, 10, 15, 20]
    assert "runs stay bonded" in capsys.readouterr().out


def test_md_command_bad_input_is_one_line(tmp_path, capsys):
    model = _model(tmp_path)
    code = main(["md", "-m", str(model), "--device", "tpu", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--device" in err[0]
    code = main(["md", "-m", str(tmp_path / "missing"), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "missing" in err[0]
    assert not (tmp_path / "x").exists()
