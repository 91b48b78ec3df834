"""``model.kind: mace``: mace-torch's MACE trained by the one training loop (`convergent
train`, DDP over 2 gloo ranks, and train/fit.py), exported by models.io, loaded back as an
ASE calculator whose forces are -dE/dx, screened; and refused in one line without the
extra. Tiny MACE (8 channels, correlation 2) on the EMT set of moldataset.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from convergent.cli import main
from convergent.config import load_config
from convergent.core.errors import ConfigError
from convergent.models.mace import mace_installed
from convergent.runsdb.trainrecords import read_train_records
from tests.train.fdcheck import fd_check
from tests.train.moldataset import make_dataset

# e3nn pickles its generated kernels with torch.jit.save/load when a model is deep-copied
# (the trainer's FLOP count copies it); torch 2.13 calls those deprecated
pytestmark = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.(save|load)` is deprecated:DeprecationWarning")

needs_mace = pytest.mark.skipif(not mace_installed(),
                                reason="mace-torch not installed (pip install 'convergent[mace]')")

TINY = [
    "model.kind=mace", "model.mace.channels=8", "model.mace.correlation=2",
    "model.mace.max_ell=2", "model.mace.radial_mlp=[16,16]",
    "train.device=cpu", "train.steps=12", "train.global_batch_atoms=512", "train.lr=5e-2",
    "train.warmup_steps=0", "train.val_every=12", "train.threads=1",
    "metrics.tensorboard=false", "metrics.log_every=1", "checkpoint.interval=0",
]


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """24 train + 8 val EMT records (H, C, N, O; different molecules in val)."""
    return make_dataset(tmp_path_factory.mktemp("macedata"), n_train=24, n_val=8)


def _train(tmp: Path, data: tuple[Path, Path], nproc: int, name: str) -> tuple[Path, list]:
    run = tmp / name
    code = main(["train", *_sets([*TINY, f"train.dataset={data[0]}", f"train.val_dataset={data[1]}"]),
                 "--nproc", str(nproc), "--run-dir", str(run)])
    assert code == 0
    steps, vals = read_train_records(run / "metrics.jsonl", last_attempt=True)
    assert [s.step for s in steps] == list(range(1, 13)) and len(vals) == 1
    return run, steps


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory, data) -> tuple[Path, list]:
    """`convergent train --nproc 2` (DDP, gloo): the run directory and its step records."""
    return _train(tmp_path_factory.mktemp("mace_ddp"), data, 2, "ddp")


@needs_mace
def test_convergent_train_trains_mace_over_two_ranks_and_its_loss_falls(ddp_run):
    run, steps = ddp_run
    losses = [s.loss for s in steps]
    # one full-batch step per record set (512 atoms hold all 24 molecules): a falling loss
    assert all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses
    assert steps[0].world == 2 and steps[0].strategy == "ddp"
    meta = json.loads((run / "ckpt" / "final" / "model_config.json").read_text())
    assert meta["kind"] == "mace" and meta["model"]["mace"]["channels"] == 8
    assert meta["elements"] == [1, 6, 7, 8]


@needs_mace
def test_ddp_over_two_ranks_repeats_the_single_process_run(tmp_path, data, ddp_run):
    """The global batch plan makes 2 ranks the 1-process run up to summation order: MACE
    needs no unused-parameter search in DDP (every parameter reaches the energy)."""
    _, two = ddp_run
    _, one = _train(tmp_path, data, 1, "single")
    a, b = np.array([s.loss for s in one]), np.array([s.loss for s in two])
    np.testing.assert_allclose(b, a, rtol=1e-4)


@needs_mace
def test_the_exported_mace_loads_as_itself_and_screens(tmp_path, data, ddp_run):
    from convergent.models.io import load_model
    from convergent.models.mace import MaceModel

    final = ddp_run[0] / "ckpt" / "final"
    model, cfg = load_model(final)
    assert isinstance(model, MaceModel) and cfg.kind == "mace"
    assert model.elements == (1, 6, 7, 8) and model.trained_elements == (1, 6, 7, 8)
    assert float(model.atomref[8]) != 0.0  # the element references of the training set
    out = tmp_path / "screen"
    assert main(["screen", "--data", str(data[1]), "--model", str(final), "--out", str(out),
                 "--select", "2"]) == 0
    rows = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(np.isfinite(r["energy_pred"]) for r in rows)


@needs_mace
@pytest.mark.numerics
def test_fit_trains_a_float64_mace_whose_calculator_forces_are_minus_the_energy_gradient(tmp_path, data):
    """train/fit.py (the learn committee's path) with model.mace.dtype=float64; the
    exported directory as an ASE calculator: F = -dE/dx to float64 central differences."""
    from ase.build import molecule

    from convergent.models.calculator import SurrogateCalculator
    from convergent.train.fit import fit

    cfg = load_config(None, [*TINY, f"train.dataset={data[0]}", "train.steps=3",
                             "model.mace.dtype=float64", "train.val_every=0"])
    summary = fit(cfg, tmp_path / "fit")
    assert summary["steps"] == 3 and np.isfinite(summary["final"]["loss"])
    calc = SurrogateCalculator(summary["final_dir"])
    assert calc.models[0].net.scale_shift.scale.dtype == torch.float64
    atoms = molecule("CH3OH")
    atoms.positions += np.random.default_rng(0).normal(0, 0.05, atoms.positions.shape)
    eps = float(torch.finfo(torch.float64).eps)
    h = 1e-4  # truncation ~h² f''' and rounding ~eps |E| / h: both far below the tolerance
    fd_check(calc, atoms, h, lambda es, f: 1e-6 * max(1.0, abs(f)) + 100 * eps * max(map(abs, es)) / h)


@needs_mace
@pytest.mark.numerics
def test_a_float32_mace_calculator_gives_minus_the_energy_gradient(ddp_run):
    """The float32 export of `convergent train`: the same check, its tolerance the rounding
    of float32 energies (about eps32 x the network's energy) over the step."""
    from ase.build import molecule

    from convergent.models.calculator import SurrogateCalculator

    calc = SurrogateCalculator(ddp_run[0] / "ckpt" / "final")
    atoms = molecule("H2CO")
    atoms.positions += np.random.default_rng(1).normal(0, 0.05, atoms.positions.shape)
    atoms.calc = calc
    atoms.get_potential_energy()
    ref = calc.models[0].atomref.numpy()[atoms.numbers].sum()
    net = abs(calc.results["energy"] - ref)  # the float32 part: MACE's energy + the prior
    eps, h = float(torch.finfo(torch.float32).eps), 1e-2
    fd_check(calc, atoms, h, lambda es, f: 2e-3 * max(1.0, abs(f)) + 100 * eps * max(net, 1.0) / h)


def test_mace_settings_are_a_bounded_typed_section():
    cfg = load_config(None, ["model.kind=mace", "model.mace.channels=16", "model.mace.max_L=2"])
    assert cfg.model.mace.hidden_irreps == "16x0e+16x1o+16x2e"
    assert load_config(None, ["model.kind=mace"]).model.mace.hidden_irreps == "32x0e+32x1o"
    for bad, needle in (("model.mace.r_max=0", "model.mace.r_max"),
                        ("model.mace.correlation=9", "model.mace.correlation"),
                        ("model.mace.radial_mlp=[64,0]", "model.mace.radial_mlp"),
                        ("model.mace.dtype=float16", "model.mace.dtype")):
        with pytest.raises(ConfigError, match=needle):
            load_config(None, ["model.kind=mace", bad])
    with pytest.raises(ConfigError, match="model.forces.*autograd with model.kind=mace"):
        load_config(None, ["model.kind=mace", "model.forces=direct"])


@pytest.mark.parametrize("setting, needle", [
    ("parallel.strategy=pipeline", "pipeline is not supported for model.kind=mace"),
    ("precision.dtype=bf16", "precision.dtype=bf16 is not supported for model.kind=mace"),
])
def test_what_mace_cannot_run_is_refused_before_launch_and_by_the_task(setting, needle):
    from convergent.train.tasks import check_before_launch, make_task

    cfg = load_config(None, ["model.kind=mace", setting])
    with pytest.raises(ConfigError, match=needle):
        check_before_launch(cfg, data=False)
    with pytest.raises(ConfigError, match=needle):
        make_task(cfg)  # train/fit.py's path


BLOCK_MACE = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "mace" or name.startswith("mace."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
"""


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_importing_convergent_does_not_import_mace(tmp_path):
    code = ("import sys\n"
            "import convergent.cli, convergent.train.tasks, convergent.train.trainer\n"
            "import convergent.models.io, convergent.models.mace, convergent.models.calculator\n"
            "import convergent.screen.predict\n"
            "from convergent.config import load_config\n"
            "from convergent.train.tasks import check_before_launch\n"
            "cfg = load_config(None, ['model.kind=mace'])\n"
            "try:\n    check_before_launch(cfg, data=False)\nexcept Exception:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mace', 'e3nn')))\n")
    out = _python(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_without_mace_the_train_command_is_one_line_naming_the_extra(tmp_path, data):
    """A meta-path finder makes `import mace` fail as on a machine without the extra."""
    code = BLOCK_MACE + (
        "from convergent.cli import main\n"
        f"sys.exit(main(['train', '--set', 'model.kind=mace', '--set', 'train.dataset={data[0]}',"
        f" '--nproc', '1', '--run-dir', {str(tmp_path / 'run')!r}]))\n")
    out = _python(code, tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "model.kind=mace needs mace-torch" in lines[0]
    assert "pip install 'convergent[mace]'" in lines[0]
    assert not (tmp_path / "run").exists()  # refused before the run directory


@needs_mace
def test_without_mace_a_saved_mace_model_is_one_error_naming_the_extra(tmp_path, ddp_run):
    final = ddp_run[0] / "ckpt" / "final"
    code = BLOCK_MACE + (
        "from convergent.core.errors import NotAvailableError\n"
        "from convergent.models.calculator import SurrogateCalculator\n"
        "try:\n"
        f"    SurrogateCalculator({str(final)!r})\n"
        "except NotAvailableError as exc:\n"
        "    print(exc.message, '|', exc.hint)\n")
    out = _python(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "needs mace-torch" in out.stdout and "convergent[mace]" in out.stdout
