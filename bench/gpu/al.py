"""On one CUDA GPU: retrospective active learning on nci2k, the ``gpu`` preset (issue 41).

bench/learn/retrospective.py with ``--preset gpu``: the issue's ~2,000-label budget, 5 seeds x
4 strategies (ours, random, spread_topk, oracle), every committee member trained by the one
training loop on the GPU (``train.device=cuda``), campaigns sharing the GPU
``--processes`` at a time (8 on the 16 cores of a lent machine). The records come from
``bench/data/nci2k_v1_retro.npz`` when it is there (``python -m bench.learn.retrospective
--export-npz bench/data/nci2k_v1_retro.npz`` writes it here; it is what a device call
carries beside ``.gpuA`` and ``.gpuC``, see docs/benchmarks.md), else from the built
nci2k chunks. Writes bench/results/active_learning_retrospective.json (+ .png) unless
``--out``; every other option is bench/learn/retrospective.py's. On a machine without
CUDA it prints one line and exits with code 2.

Usage: ``python -m bench.gpu.al [--out $OUT/al.json] [--allow-dirty] [--seeds 0 1 2 3 4]``
"""

from __future__ import annotations

import sys

from bench.lib.paths import DATA

NPZ = DATA / "nci2k_v1_retro.npz"


def main(argv: list[str] | None = None) -> int:
    import torch

    args = list(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("bench/gpu/al.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from bench.learn.retrospective import main as retrospective

    if "--data" not in args and NPZ.is_file():
        args += ["--data", str(NPZ)]
    return retrospective(["--preset", "gpu", *args])


if __name__ == "__main__":
    sys.exit(main())
