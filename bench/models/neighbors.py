"""Periodic neighbour lists: our torch cell list vs vesin, by system size (CPU).

Both sides build the full list (both directions, lattice shifts, distances) through
:func:`convergent.models.atoms.neighbor_list` with ``backend="torch"`` or ``"vesin"`` on
the same inputs: rattled fcc Cu crystals (a = 3.6 Å, cutoff 5 Å) of growing size, one
structure per call, and a training-like batch of 32 small periodic cells. Torch runs on
1 thread (vesin's CPU path is single-threaded), so the comparison is thread for thread.
Sides run interleaved for ``--rounds`` rounds; each round times ``--repeat`` calls and
reports ms per call; the JSON gives median and spread per size.

    python -m bench.models.neighbors --rounds 5 --out bench/results/neighbors.json

The ``auto`` backend uses vesin for periodic structures on the CPU when it is installed.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np
import torch

from bench.lib.harness import Side, add_args, check_clean, interleave, write_result
from convergent.models.atoms import neighbor_list, vesin_available

CUTOFF = 5.0
REPS = (2, 4, 8, 12)  # n x n x n cubic cells of 4 atoms: 32 ... 6912 atoms


def crystal(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((n, n, n))
    atoms.rattle(0.1, seed=seed)
    return torch.tensor(atoms.positions), torch.tensor(atoms.cell.array)


def cases() -> dict[str, dict[str, Any]]:
    out = {}
    for n in REPS:
        pos, cell = crystal(n, n)
        out[f"atoms_{len(pos)}"] = {"positions": pos, "cell": cell, "pbc": torch.ones(3, dtype=torch.bool)}
    small = [crystal(2, 100 + i) for i in range(32)]  # 32 cells of 32 atoms
    out["batch_32x32"] = {
        "positions": torch.cat([p for p, _ in small]),
        "batch": torch.arange(32).repeat_interleave(32),
        "n_molecules": 32,
        "cell": torch.stack([c for _, c in small]),
        "pbc": torch.ones(32, 3, dtype=torch.bool),
    }
    return out


def make_side(backend: str, data: dict[str, dict[str, Any]], repeat: int):
    def run(_round: int) -> dict[str, float]:
        res = {}
        for name, kw in data.items():
            neighbor_list(cutoff=CUTOFF, backend=backend, **kw)  # warm
            t0 = time.perf_counter()
            for _ in range(repeat):
                nl = neighbor_list(cutoff=CUTOFF, backend=backend, **kw)
            res[f"{name}_ms"] = (time.perf_counter() - t0) / repeat * 1e3
            res[f"{name}_edges"] = nl.num_edges
        return res

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, default_out="bench/results/neighbors.json", rounds=5)
    ap.add_argument("--repeat", type=int, default=3, help="calls timed per round and size")
    args = ap.parse_args()
    check_clean(args)
    if not vesin_available():
        sys.exit("error: vesin is not installed (pip install 'convergent[vesin]')")
    torch.set_num_threads(1)
    data = cases()
    settings = {"cutoff": CUTOFF, "torch_threads": 1, "repeat": args.repeat,
                "systems": {k: int(v["positions"].shape[0]) for k, v in data.items()}}
    sides = [Side("torch", make_side("torch", data, args.repeat), {**settings, "backend": "torch"}),
             Side("vesin", make_side("vesin", data, args.repeat), {**settings, "backend": "vesin"})]
    res = interleave("neighbors", sides, rounds=args.rounds, differences=[
        "vesin converts positions to float64 numpy and back; torch works on the tensors",
    ])
    for name in data:
        res.headline[f"speedup_{name}"] = res.ratio("torch", "vesin", f"{name}_ms")
        assert res.median("torch", f"{name}_edges") == res.median("vesin", f"{name}_edges")
    write_result(res, args)
    print(np.round(np.array([[res.median(s, f"{n}_ms") for n in data] for s in ("torch", "vesin")]), 2))
    print(res.headline)


if __name__ == "__main__":
    main()
