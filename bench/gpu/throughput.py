"""GPU benchmark: ours fp32 vs bf16 vs the transformers / plain-PyTorch baselines, one run.

Needs one CUDA GPU (and the project installed: ``pip install -e '.[dev]'`` for
transformers). On a machine without CUDA it prints one line and exits with code 2.
Runs in under 10 minutes on one H100; writes ``bench/results/gpu.json``.

Measured side by side with bench/lib/harness.py: every side once per round, rounds
interleaved (``--rounds``, default 3); each number is the median over rounds of the
per-round median over the timed steps, with the spread (min, max, IQR) over rounds; the
JSON carries the commit (a dirty tree is refused unless ``--allow-dirty``), versions, the
machine, the load before/after, each side's settings and the differences between sides:

* **molecular** (the surrogate, hidden 256, 6 layers, batches of ``--mol-atoms`` atoms,
  default 16,384 <= 32,768, autograd forces): our trainer (``convergent.train``, one
  process, prefetch thread, CUDA-event step timer) in fp32 (TF32) and bf16, and a plain
  PyTorch loop on the same model with every batch prebuilt on the GPU (the model's
  ceiling, no input pipeline) in bf16. Atoms/s, ``data_wait_s / step_s``.
* **edge** (``--only edge``, about a minute and a half; not in the default ``--only``): the
  molecular model's ``model.edge_kernel`` — ``index`` (the pre-CSR scatter), ``torch``
  (segment sums over receiver-sorted edges), ``triton`` (the fused kernel) — in fp32 (TF32)
  and bf16, as training steps (autograd forces: double backward; AdamW) and, for torch and
  triton, as inference (energies and forces, first-order backward), each a plain loop on
  the same two batches prebuilt on the GPU, ``--edge-steps`` steps. Atoms/s.
* **LM** (a Llama of hidden 768, 12 layers, 12 heads, seq 1024, 16 sequences, vocab
  32,000): our trainer in bf16 (eager, and with ``train.compile=model``, the default on CUDA) and fp32, and
  transformers' ``LlamaForCausalLM`` of the same shape (SDPA attention, bf16 autocast,
  AdamW at the trainer's LR, the same clipping) eager and under ``torch.compile``:
  eager is compared with eager and compiled with compiled (no best-of-two side).
  Tokens/s; MFU = counted FLOPs x tokens/s / the GPU's dense bf16 peak.
* **serving** (``--only serve``, bench/gpu/serve.py, issue 39 item 9): a random 1.1B Llama
  on a 1,000-request trace (prompts 128-1,024, outputs 64-512, all at t=0, EOS ignored);
  our engine (one stage, up to 256 sequences, the CUDA defaults) in bf16 and fp32, and
  transformers' ``generate`` in bf16 on the trace's first ``--hf-requests`` requests in static
  batches of ``--hf-batch`` (ours on the same subset beside it); TTFT/TPOT, the step's split
  (host prepare, GPU, sync), the memory-bandwidth floor of the run's steps and the TD-Pipe vs
  interleaved projection onto 4 PCIe GPUs (bench/gpu/serve_floor.py).

Top-level keys of the JSON: ``commit``, ``dirty``, ``device``,
``molecular_atoms_per_s_bf16`` (with ``molecular_batch_atoms``),
``molecular_bf16_speedup_vs_fp32``, ``data_wait_fraction``, ``edge_train_atoms_per_s_bf16``
(per kernel), ``edge_torch_vs_index_train_bf16``, ``edge_triton_vs_torch_train_bf16``,
``edge_triton_vs_torch_infer_bf16``, ``edge_bf16_vs_fp32_train`` (per kernel), ``lm_mfu_bf16``,
``lm_vs_hf_train`` (eager vs eager), ``lm_vs_hf_train_compiled``, ``device_peaks`` and
``{molecular,lm}_{matmul,bandwidth}_fraction_bf16`` (bench/gpu/peaks.py),
the ``serve_*`` keys of bench/gpu/serve.py's ``serve_keys`` (``serve_output_tok_s_bf16``,
``serve_bf16_speedup_vs_fp32``, ``serve_vs_hf_generate``, TTFT/TPOT p50/p99,
``serve_step_split``, ``serve_bandwidth_floor_tok_s``, ``serve_fraction_of_floor``,
``serve_projection_4gpu_pcie``), ``torch``, ``cuda``,
``provenance``, ``differences``, ``complete`` and ``parts`` (the JSON is written after every
part, so a run cut short keeps what it finished); the harness result of each part under ``molecular``,
``edge``, ``lm``, ``serve`` (settings, per_round, summary).

Usage: ``python -m bench.gpu.throughput [--rounds 3] [--serve-rounds N] [--steps 30] [--lm-steps 20]
[--edge-steps 12] [--hf-requests 256] [--hf-batch 256] [--only molecular,lm,serve]`` (``edge`` and ``serve_modes``, the decode
graphs and async scheduling on and off: bench/gpu/serve_modes.py, are parts too; the parts run in
``--only``'s order; each runs ``--rounds`` rounds, serving, the longest, ``--serve-rounds``
if given).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.gpu.edge import bench_edge_kernel, edge_keys
from bench.gpu.peaks import fraction_keys, with_fractions
from bench.gpu.serve import bench_serve, serve_keys
from bench.gpu.serve_modes import bench_serve_modes, graphs_speedup
from bench.gpu.steps import cuda_timed
from bench.lib.harness import Side, check_clean, interleave, provenance, write_result
from bench.lib.paths import RESULTS

NAMES = ["H2O", "CH4", "NH3", "C2H6", "CH3OH", "C2H4", "HCN", "CO2", "H2CO", "C2H2", "CH3CN",
         "C3H8", "CH3CHO", "CH3CH2OH", "HCOOH", "CH3COOH", "C6H6"]
DEVICE = "cuda"  # the trainer sides run here
LM_SHAPE = dict(hidden=768, layers=12, heads=12, seq=1024, batch=16, vocab=32000, mlp_ratio=4)


LR = 1e-3  # our trainer's default train.lr; the plain and transformers loops use it too


# ----------------------------------------------------------------------------- molecular


def make_molecules(root: Path, n: int, seed: int = 0) -> Path:
    """``n`` rattled G2 molecules with random labels (throughput only: labels unused)."""
    import numpy as np
    from ase.build import molecule

    from convergent.data.writer import write_records

    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        atoms = molecule(NAMES[i % len(NAMES)])
        pos = atoms.positions + rng.normal(0, 0.08, atoms.positions.shape)
        recs.append({"key": f"m{i}", "molecule_id": NAMES[i % len(NAMES)],
                     "numbers": atoms.numbers.astype(np.int64), "positions": pos,
                     "energy": float(rng.normal()), "forces": rng.normal(0, 0.1, pos.shape)})
    write_records(root / "train", recs, compression="none")
    return root / "train"


def _trainer_run(tmp: Path, sets: list[str], name: str, warmup: int) -> dict[str, float]:
    """Our trainer in this process (strategy single); medians over the timed steps."""
    from convergent.config import load_config
    from convergent.runsdb.rundir import open_run
    from convergent.train.trainer import Trainer

    cfg = load_config(None, [
        *sets, "parallel.strategy=single", f"train.device={DEVICE}", "train.val_every=0",
        "checkpoint.interval=0", "checkpoint.export_final=false", "checkpoint.resume=false",
        "metrics.tensorboard=false", "metrics.log_every=100000", "train.warmup_steps=2",
    ])
    run = open_run(cfg, tmp / f"{name}-{time.monotonic_ns()}")
    trainer = Trainer(cfg, run)
    trainer.train()
    rows = trainer.history[warmup:]
    return {
        "per_s": statistics.median(r.units_per_s for r in rows),
        "step_s": statistics.median(r.step_s for r in rows),
        "data_wait_fraction": statistics.median(r.data_wait_s / r.step_s for r in rows),
        "mfu": statistics.median(r.mfu for r in rows) if rows[0].mfu is not None else None,
    }


def _plain_molecular(data: Path, atoms: int, steps: int, warmup: int) -> Callable[[], dict]:
    """Plain PyTorch bf16 loop, every batch prebuilt on the GPU (the model's ceiling)."""
    import torch

    from convergent.config import load_config
    from convergent.train.tasks import make_task

    cfg = load_config(None, [f"train.dataset={data}", "model.hidden=256", "model.layers=6",
                             f"train.global_batch_atoms={atoms}"])
    task = make_task(cfg)
    dev = torch.device("cuda")
    batches = [task.micro_batches(s, 0, 1, 1)[0] for s in range(4)]
    batches = [task.to(mb, dev) for mb in batches]

    def run() -> dict:
        torch.manual_seed(0)
        model = task.build_model().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
        def step(i: int) -> float:
            mb = batches[i % len(batches)]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = task.loss(model, mb, 1)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return mb.units

        return cuda_timed(step, steps, warmup)

    return run


def bench_molecular(tmp: Path, rounds: int, steps: int, atoms: int) -> dict[str, Any]:
    n_mol = max(64, 4 * atoms // 6)  # G2 molecules average ~6 atoms: ~4 batches per epoch
    data = make_molecules(tmp / "mol", n_mol)
    base = [f"train.dataset={data}", "model.hidden=256", "model.layers=6",
            f"train.global_batch_atoms={atoms}", f"train.steps={steps}"]
    warmup = min(5, steps // 3)
    sides: dict[str, Callable[[], dict]] = {
        "ours_fp32": lambda: _trainer_run(tmp, [*base, "precision.dtype=fp32"], "mol32", warmup),
        "ours_bf16": lambda: _trainer_run(tmp, [*base, "precision.dtype=bf16"], "mol16", warmup),
        "plain_bf16_prebuilt": _plain_molecular(data, atoms, steps, warmup),
    }
    common = {"model": "molecular, hidden 256, 6 layers", "batch_atoms": atoms, "steps": steps,
              "timed_steps": f"{warmup}..{steps}", "optimizer": f"AdamW lr {LR}", "grad_clip": 10.0,
              "data": f"{n_mol} rattled G2 molecules, random labels"}
    settings = {"ours_fp32": {**common, "side": "convergent trainer, fp32 (TF32)"},
                "ours_bf16": {**common, "side": "convergent trainer, bf16 autocast"},
                "plain_bf16_prebuilt": {**common, "side": "plain PyTorch loop, bf16 autocast, "
                                                          "every batch prebuilt on the GPU"}}
    diffs = ["plain_bf16_prebuilt has no input pipeline (4 batches prebuilt on the GPU, reused): "
             "it is the model's ceiling, ours reads, collates and copies every batch",
             "ours_fp32 runs fp32 with TF32 matmuls, the others bf16 autocast"]
    return with_fractions(_rounds("gpu.molecular", sides, settings, rounds, diffs), base,
                          DEVICE, _med)


# ----------------------------------------------------------------------------- LM


def _hf_lm(steps: int, warmup: int, compiled: bool) -> Callable[[], dict]:
    import torch
    import transformers

    s = LM_SHAPE
    cfg = transformers.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
        intermediate_size=s["mlp_ratio"] * s["hidden"], max_position_embeddings=2 * s["seq"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda()
    fwd = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), device="cuda", generator=g)

    def step(_: int) -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, s["vocab"]), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return s["batch"] * s["seq"]

    return lambda: cuda_timed(step, steps, warmup)


def bench_lm(tmp: Path, rounds: int, steps: int) -> dict[str, Any]:
    s = LM_SHAPE
    base = ["model.kind=llama", f"model.hidden={s['hidden']}", f"model.layers={s['layers']}",
            f"model.heads={s['heads']}", f"model.mlp_ratio={s['mlp_ratio']}",
            f"train.seq_len={s['seq']}", f"train.vocab_size={s['vocab']}",
            f"train.global_batch_seqs={s['batch']}", f"train.batch_seqs={s['batch']}",
            f"train.steps={steps}"]
    warmup = min(5, steps // 3)
    sides: dict[str, Callable[[], dict]] = {
        "ours_bf16": lambda: _trainer_run(
            tmp, [*base, "precision.dtype=bf16", "train.compile=off"], "lm16", warmup),
        "ours_bf16_compile": lambda: _trainer_run(
            tmp, [*base, "precision.dtype=bf16", "train.compile=model"], "lm16c", warmup),
        "ours_fp32": lambda: _trainer_run(
            tmp, [*base, "precision.dtype=fp32", "train.compile=off"], "lm32", warmup),
        "hf_sdpa_eager_bf16": _hf_lm(steps, warmup, compiled=False),
        "hf_sdpa_compile_bf16": _hf_lm(steps, warmup, compiled=True),
    }
    common = {"shape": s, "steps": steps, "timed_steps": f"{warmup}..{steps}",
              "optimizer": f"AdamW lr {LR}", "grad_clip": 10.0, "data": "random token ids"}
    settings = {
        "ours_bf16": {**common, "side": "convergent trainer, bf16 autocast, eager"},
        "ours_bf16_compile": {**common, "side": "convergent trainer, bf16, train.compile=model "
                                                "(whole model; the default on CUDA)"},
        "ours_fp32": {**common, "side": "convergent trainer, fp32 (TF32), eager"},
        "hf_sdpa_eager_bf16": {**common, "side": "transformers LlamaForCausalLM, SDPA, bf16 "
                                                 "autocast, eager"},
        "hf_sdpa_compile_bf16": {**common, "side": "the same under torch.compile (whole model)"},
    }
    diffs = ["ours draws a new synthetic batch each step through its input pipeline; the "
             "transformers side reuses one batch already on the GPU",
             "ours_fp32 runs fp32 with TF32 matmuls, the others bf16 autocast"]
    return with_fractions(_rounds("gpu.lm", sides, settings, rounds, diffs), base, DEVICE, _med)


# ----------------------------------------------------------------------------- driver


def _rounds(name: str, sides: dict[str, Callable[[], dict]], settings: dict[str, dict],
            rounds: int, differences: list[str]) -> dict[str, Any]:
    """Run every side once per round (interleaved, bench/lib/harness.py); medians with spread.

    A side that raises is recorded with its error and skipped in later rounds (one failing
    side must not end the run)."""
    failed: dict[str, str] = {}

    def guard(side: str, fn: Callable[[], dict]) -> Callable[[int], dict]:
        def run(r: int) -> dict:
            if side in failed:
                return {"error": failed[side]}
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - one failing side must not end the run
                failed[side] = f"{type(exc).__name__}: {exc}"[:500]
                print(f"  round {r + 1}/{rounds} {side}: FAILED {failed[side]}", flush=True)
                return {"error": failed[side]}

        return run

    res = interleave(name, [Side(k, guard(k, fn), settings.get(k, {})) for k, fn in sides.items()],
                     rounds=rounds, differences=differences)
    out = res.to_dict()
    out["failed"] = failed
    for k in ("benchmark", "commit", "dirty"):
        out.pop(k, None)
    return out


def _med(d: dict, side: str, key: str = "per_s") -> float | None:
    if side in d.get("failed", {}):
        return None
    try:
        return d["summary"][side][key]["median"]
    except (KeyError, TypeError):
        return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _result(res: dict[str, Any], args: argparse.Namespace, prov: dict[str, Any], t0: float,
            torch: Any, complete: bool) -> dict[str, Any]:
    """The JSON written: the named top-level keys from the parts in ``res`` so far."""
    prov = {**prov, "load_avg_after": list(os.getloadavg()),
            "finished_utc": datetime.now(UTC).isoformat(timespec="seconds")}
    mol, lm, srv = res.get("molecular", {}), res.get("lm", {}), res.get("serve", {})
    return {
        "benchmark": "gpu",
        "commit": prov["commit"],
        "dirty": prov["dirty"],
        "complete": complete,
        "parts": list(res),
        "device": torch.cuda.get_device_name(0),
        "molecular_atoms_per_s_bf16": _med(mol, "ours_bf16"),
        "molecular_batch_atoms": args.mol_atoms,
        "molecular_bf16_speedup_vs_fp32": _ratio(_med(mol, "ours_bf16"), _med(mol, "ours_fp32")),
        "data_wait_fraction": _med(mol, "ours_bf16", "data_wait_fraction"),
        **edge_keys(res.get("edge", {}), _med, _ratio),
        **fraction_keys(res),
        "lm_mfu_bf16": _med(lm, "ours_bf16", "mfu"),
        "lm_mfu_bf16_compile": _med(lm, "ours_bf16_compile", "mfu"),
        "lm_vs_hf_train": _ratio(_med(lm, "ours_bf16"), _med(lm, "hf_sdpa_eager_bf16")),
        "lm_vs_hf_train_compiled": _ratio(_med(lm, "ours_bf16_compile"),
                                          _med(lm, "hf_sdpa_compile_bf16")),
        **serve_keys(srv, _med, _ratio),
        **graphs_speedup(res.get("serve_modes", {}), _med),
        "statistic": "median over rounds of each side's per-round median (spread in summary)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "rounds": args.rounds,
        "serve_rounds": args.serve_rounds or args.rounds,
        "steps": args.steps,
        "lm_steps": args.lm_steps,
        "edge_steps": args.edge_steps,
        "wall_s": time.monotonic() - t0,
        "provenance": prov,
        "differences": {k: v.get("differences", []) for k, v in res.items()},
        **res,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30, help="molecular steps per side and round")
    ap.add_argument("--lm-steps", type=int, default=20, help="LM steps per side and round")
    ap.add_argument("--edge-steps", type=int, default=12,
                    help="steps per side and round of the edge part")
    ap.add_argument("--serve-rounds", type=int, default=None,
                    help="rounds of the serving part (default: --rounds)")
    ap.add_argument("--hf-requests", type=int, default=256,
                    help="serving: the trace's first N requests for transformers generate")
    ap.add_argument("--hf-batch", type=int, default=256, help="serving: generate's static batch")
    ap.add_argument("--mol-atoms", type=int, default=16384, help="atoms per batch (<= 32768)")
    ap.add_argument("--only", default="molecular,lm,serve")
    ap.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="write a result from a tree with uncommitted changes (it says dirty: true)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu/throughput.py needs a CUDA GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    if not 1 <= args.mol_atoms <= 32768:
        print("--mol-atoms must be between 1 and 32768", file=sys.stderr)
        return 2
    parts = {"molecular": lambda tmp: bench_molecular(tmp, args.rounds, args.steps, args.mol_atoms),
             "edge": lambda tmp: bench_edge_kernel(tmp, args.rounds, args.edge_steps, args.mol_atoms),
             "lm": lambda tmp: bench_lm(tmp, args.rounds, args.lm_steps),
             "serve": lambda tmp: bench_serve(tmp, args.serve_rounds or args.rounds,
                                              args.hf_requests, args.hf_batch),
             "serve_modes": lambda tmp: bench_serve_modes(tmp, args.serve_rounds or args.rounds)}
    order = list(dict.fromkeys(args.only.split(",")))
    unknown = [n for n in order if n not in parts]
    if unknown:
        print(f"--only: unknown part {unknown[0]!r} (choose from {', '.join(parts)})",
              file=sys.stderr)
        return 2
    check_clean(args)
    t0 = time.monotonic()
    prov = provenance()
    res: dict[str, Any] = {}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="convergent-gpu-bench-") as d:
        for name in order:  # in --only's order
            print(name, flush=True)
            res[name] = parts[name](Path(d))
            # written after every part: a run cut short keeps the parts it finished
            out = _result(res, args, prov, t0, torch, complete=len(res) == len(order))
            write_result(out, args)
    print(json.dumps({k: v for k, v in out.items() if k not in res and k != "provenance"},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
