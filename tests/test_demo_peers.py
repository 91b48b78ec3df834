"""Issue 40 item 5: `demo.peers: [mace]` trains MACE beside ours on the same split with the
same training settings, screens it on the same held-out molecules and runs the same MD
check; the report and the demo's console show one row per trained model. Without the
extra the setting is refused in one line before any work; without peers the report is as
before."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from convergent.cli import main
from convergent.config import ConvergentConfig, load_config
from convergent.core.errors import ConfigError
from convergent.models.mace import mace_installed
from convergent.monitor.comparison import ModelResult, peer_stage
from convergent.monitor.report import build_report
from convergent.runsdb.rundir import open_run
from tests.cli_exe import EXE
from tests.test_demo_e2e import TINY
from tests.train.test_mace_kind import BLOCK_MACE

# e3nn pickles its generated kernels with torch.jit.save/load (see test_mace_kind.py)
pytestmark = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.(save|load)` is deprecated:DeprecationWarning")

needs_mace = pytest.mark.skipif(not mace_installed(),
                                reason="mace-torch not installed (pip install 'convergent[mace]')")
PEERS = ["--set", "demo.peers=[mace]"]
SECTION = "## Models side by side (held-out molecules)"


def _rows(md: str) -> list[list[str]]:
    """The cells of the models table's rows (header and rule left out)."""
    table = md.split(SECTION)[1].split("\n\n")[1].splitlines()
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in table[2:]]


@needs_mace
def test_the_demo_trains_mace_beside_ours_and_reports_both_then_resumes(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run([EXE, "demo", "--run-dir", str(run_dir), *TINY, *PEERS],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    stages = json.loads((run_dir / "stages.json").read_text())
    assert list(stages) == ["simulate", "data", "train", "screen", "md_check", "peer_mace", "learn"]

    # the peer's typed record: the same held-out structures, the same MD check, its own run
    mace = ModelResult.from_dict(stages[peer_stage("mace")])
    assert (mace.name, mace.model_kind, mace.steps) == ("mace", "mace", 6)
    assert mace.structures == stages["screen"]["structures"] == stages["data"]["val_frames"]
    assert mace.total_runs == stages["md_check"]["total_runs"] == 6
    for x in (mace.energy_mae, mace.force_mae, mace.baseline_over_model, mace.train_s):
        assert x is not None and math.isfinite(x) and x > 0
    assert 0 < mace.params < stages["screen"]["params"]  # the demo's small MACE
    assert mace.baseline_energy_mae == pytest.approx(stages["screen"]["baseline_energy_mae"])
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [ModelResult.from_dict(r) for r in logged if r["kind"] == ModelResult.KIND] == [mace]
    peer = run_dir / "peers" / "mace"
    meta = json.loads((peer / "ckpt" / "final" / "model_config.json").read_text())
    assert meta["kind"] == "mace" and meta["model"]["mace"]["channels"] == 8
    assert load_config(peer / "config.yaml").train.dataset == str(run_dir / "data" / "train")
    assert (peer / "screen" / "predictions.json").is_file() and (peer / "md_check.json").is_file()

    # the report: one row per trained model, every number finite
    md = (run_dir / "report" / "report.md").read_text()
    rows = _rows(md)
    assert [r[0] for r in rows] == ["ours (molecular)", "mace"]
    for row in rows:
        assert all(math.isfinite(float(c.rstrip("x").replace(",", ""))) for c in row[1:5] + row[6:])
        assert row[5].endswith("/ 6")
    assert rows[1][1] == f"{mace.energy_mae:.4g}" and rows[1][6] == f"{mace.params:,}"
    # and the console's summary
    lines = out.stderr.split("models on the held-out molecules")[1].splitlines()
    assert any(ln.startswith("ours (molecular) ") for ln in lines)
    assert any(ln.startswith("mace ") and f"{mace.params:,}" in ln for ln in lines)

    # resume: the trained peer is skipped like every finished stage, nothing recomputed
    again = subprocess.run([EXE, "demo", "--run-dir", str(run_dir), "--resume", *TINY, *PEERS],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "peer_mace: already done" in again.stderr and again.stderr.count("already done") == 7
    assert json.loads((run_dir / "stages.json").read_text()) == stages


def test_without_mace_demo_peers_is_one_line_naming_the_extra_before_any_work(tmp_path):
    """A meta-path finder makes `import mace` fail as on a machine without the extra."""
    run = tmp_path / "run"
    code = BLOCK_MACE + (
        "from convergent.cli import main\n"
        f"sys.exit(main(['demo', '--run-dir', {str(run)!r}, '--set', 'demo.peers=[mace]']))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "demo.peers names mace, which needs mace-torch" in lines[0]
    assert "pip install 'convergent[mace]'" in lines[0]
    assert not run.exists()  # refused before the run directory


@pytest.mark.parametrize("sets, needle", [
    (["model.kind=mace", "demo.peers=[mace]"], "demo.peers names mace, which is model.kind"),
    (["demo.peers=[mace]", "precision.dtype=bf16"], "precision.dtype=bf16 is not supported for model.kind=mace"),
    (["demo.peers=[mace]", "parallel.strategy=pipeline", "model.forces=direct"],
     "pipeline is not supported for model.kind=mace"),
])
def test_a_peer_the_demo_cannot_train_is_refused_before_any_work(tmp_path, capsys, sets, needle):
    run = tmp_path / "run"
    code = main(["demo", "--run-dir", str(run), *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err, err
    assert not run.exists()


def test_demo_peers_is_a_checked_list_empty_by_default():
    assert ConvergentConfig().demo.peers == []
    assert load_config(None, ["demo.peers=[mace]"]).demo.peers == ["mace"]
    for bad, needle in (("demo.peers=[mace, mace]", "names a model kind twice"),
                        ("demo.peers=[nequip]", "demo.peers.0")):
        with pytest.raises(ConfigError, match=needle):
            load_config(None, [bad])


def _result(name: str, kind: str, **kw) -> ModelResult:  # noqa: ANN003
    base = dict(structures=3, energy_mae=0.5, energy_mae_per_atom=0.1, baseline_energy_mae=1.0,
                baseline_over_model=2.0, force_mae=0.2, stable_runs=5, total_runs=6, params=1234,
                steps=10, train_s=12.0)
    return ModelResult(name=name, model_kind=kind, **{**base, **kw})


def _run(tmp_path: Path):  # noqa: ANN202
    run = open_run(ConvergentConfig(), tmp_path / "r")
    run.mark_done("train", {"steps": 10, "wall_s": 20.0, "train_s": 15.0})
    run.mark_done("screen", {"structures": 3, "energy_mae": 0.25, "energy_mae_per_atom": 0.05,
                             "baseline_energy_mae": 1.0, "baseline_over_model": 4.0,
                             "force_mae": 0.1, "params": 115341, "model_kind": "molecular"})
    run.mark_done("md_check", {"stable_runs": 6, "total_runs": 6})
    return run


def test_without_peers_the_report_has_no_models_table(tmp_path):
    run = _run(tmp_path)
    assert SECTION not in build_report(run.path).read_text()


def test_the_report_reads_ours_from_its_stages_and_the_peer_from_its_record(tmp_path):
    run = _run(tmp_path)
    mace = _result("mace", "mace", baseline_over_model=None, params=None)
    run.mark_done(peer_stage("mace"), {**mace.to_dict(), "wall_s": 40.0})
    assert ModelResult.from_dict(run.stages()[peer_stage("mace")]) == mace
    rows = _rows(build_report(run.path).read_text())
    assert rows == [
        ["ours (molecular)", "0.25", "50.0", "0.1", "4.00x", "6 / 6", "115,341", "10", "15"],
        ["mace", "0.5", "100.0", "0.2", "n/a", "5 / 6", "n/a", "10", "12"],
    ]
