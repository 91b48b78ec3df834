"""Cost per structure (energy + forces): surrogate vs GFN2-xTB (tblite) vs PySCF
B3LYP/6-31G*, on the same molecules, one thread each.

Surrogate timings: batched screening (all structures in atom-budget batches of 2048
atoms) and one-at-a-time through the ASE calculator. The surrogate's weights do not
change its cost; it loads bench/data/xtb_pretrained (from model_accuracy.py --dataset g2) if present.
CPU time (process) is the headline because the CPU is shared; wall time is recorded too.

Writes bench/results/model_cost.json. Usage: .venv/bin/python bench/model_cost.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from molbench import DATA, dft_label, write_result, xtb_label  # noqa: E402

MOLECULES = ["H2O", "NH3", "CH3OH", "CH3CHO", "CH3CH2OH", "C6H6"]


def timed(fn):  # noqa: ANN001, ANN201
    c, w = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c, time.perf_counter() - w


def main() -> None:
    from ase.build import molecule

    from convergent.models.batching import atoms_to_record
    from convergent.models.calculator import SurrogateCalculator
    from convergent.models.config import ModelConfig
    from convergent.models.io import load_model
    from convergent.models.molecular import build_model
    from convergent.screen.predict import predict_records

    torch.set_num_threads(1)
    pre = DATA / "xtb_pretrained"
    model = load_model(pre)[0] if pre.exists() else build_model(ModelConfig())
    rows = []
    for name in MOLECULES:
        a = molecule(name)
        a.rattle(0.02, seed=0)
        (_, _, dft_wall_inner), dft_cpu, dft_wall = timed(lambda a=a: dft_label(a))
        (_, _, _), xtb_cpu, xtb_wall = timed(lambda a=a: xtb_label(a))
        b = a.copy()
        b.calc = SurrogateCalculator(model)
        b.get_potential_energy()  # warm-up
        reps = 20

        def single(b=b, reps=reps) -> None:
            for k in range(reps):
                b.positions[0, 0] += 1e-4 * (-1) ** k  # force a recalculation
                b.get_forces()

        _, s_cpu, s_wall = timed(single)
        # batched: 256 copies of this molecule
        recs = [atoms_to_record(a, f"{name}-{i}") for i in range(256)]
        predict_records([model], recs[:16], 2048)  # warm-up
        _, bt_cpu, bt_wall = timed(lambda recs=recs: predict_records([model], recs, 2048))
        row = {
            "molecule": name, "n_atoms": len(a),
            "dft_b3lyp_631gs": {"cpu_s": dft_cpu, "wall_s": dft_wall},
            "gfn2_xtb": {"cpu_s": xtb_cpu, "wall_s": xtb_wall},
            "surrogate_single_ase": {"cpu_s": s_cpu / reps, "wall_s": s_wall / reps},
            "surrogate_batched": {"cpu_s": bt_cpu / len(recs), "wall_s": bt_wall / len(recs)},
        }
        row["speedup_dft_vs_surrogate_batched_cpu"] = dft_cpu / row["surrogate_batched"]["cpu_s"]
        row["speedup_dft_vs_surrogate_single_cpu"] = dft_cpu / row["surrogate_single_ase"]["cpu_s"]
        row["speedup_xtb_vs_surrogate_batched_cpu"] = xtb_cpu / row["surrogate_batched"]["cpu_s"]
        print(row, flush=True)
        rows.append(row)

    def total(key: str) -> float:
        return float(sum(r[key]["cpu_s"] for r in rows))

    summary = {
        "cpu_s_per_structure_mean": {k: total(k) / len(rows) for k in
                                     ("dft_b3lyp_631gs", "gfn2_xtb", "surrogate_single_ase", "surrogate_batched")},
        "speedup_dft_over_surrogate_batched": total("dft_b3lyp_631gs") / total("surrogate_batched"),
        "speedup_dft_over_surrogate_single": total("dft_b3lyp_631gs") / total("surrogate_single_ase"),
        "speedup_xtb_over_surrogate_batched": total("gfn2_xtb") / total("surrogate_batched"),
        "min_speedup_dft_over_surrogate_batched": float(np.min([r["speedup_dft_vs_surrogate_batched_cpu"] for r in rows])),
    }
    summary["criterion_1000x_faster_than_dft"] = summary["speedup_dft_over_surrogate_batched"] >= 1000
    path = write_result("model_cost", {
        "what": "energy + forces per structure, 1 thread; surrogate batched = 256 copies per molecule "
                "in 2048-atom batches; single = ASE calculator, one call per structure",
        "surrogate": {"config": model.cfg.model_dump(), "weights": str(pre) if pre.exists() else "random init"},
        "rows": rows, "summary": summary,
    })
    print(summary)
    print("wrote", path)


if __name__ == "__main__":
    main()
