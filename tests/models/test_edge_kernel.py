"""Receiver-sorted (CSR) edges, segment sums and the edge-kernel switch (issue 42 item 2).

The Triton kernel's own checks are in ``triton_interpreted.py`` beside this file: Triton's
interpreter works only where ``TRITON_INTERPRET=1`` was set before ``triton`` was first
imported, so :func:`test_triton_kernels_under_the_interpreter` runs them in a fresh
process. Tolerances are multiples of the compared dtype's ``eps`` at the compared values'
magnitude: the paths differ only in the order of additions.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ase import Atoms
from ase.build import bulk

from convergent.core.errors import ConfigError
from convergent.models.atoms import neighbor_list, vesin_available
from convergent.models.batching import atoms_to_record, collate_records
from convergent.models.config import ModelConfig
from convergent.models.molecular import build_model
from convergent.models.segments import Segments, gather, segment_max, segment_sum
from tests.models.edgehelpers import (
    assert_close,
    assert_energies_close,
    mixed_batch,
    run_model,
)

ROOT = Path(__file__).resolve().parents[2]

# -- the neighbour list is receiver-sorted ----------------------------------------------


@pytest.mark.parametrize("backend", ["torch", pytest.param("vesin", marks=pytest.mark.skipif(
    not vesin_available(), reason="vesin not installed (the 'vesin' extra)"))])
@pytest.mark.parametrize("cap", [None, 6])
def test_neighbor_list_is_sorted_by_centre_with_row_ptr(backend, cap):
    cu = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2))
    cu.rattle(0.1, seed=1)
    nl = neighbor_list(torch.tensor(cu.positions), 4.0, cell=torch.tensor(cu.cell.array),
                       pbc=torch.tensor(cu.pbc), backend=backend, max_neighbors=cap,
                       overflow="drop")
    src = nl.edge_index[0]
    assert bool((src[1:] >= src[:-1]).all())
    counts = torch.bincount(src, minlength=len(cu))
    assert nl.row_ptr.tolist() == [0, *torch.cumsum(counts, 0).tolist()]
    b = mixed_batch()  # molecules with a lone atom and atoms without neighbours
    nl = neighbor_list(b.positions, 5.0, b.batch, b.n_molecules)
    counts = torch.bincount(nl.edge_index[0], minlength=b.num_atoms)
    assert nl.row_ptr.tolist() == [0, *torch.cumsum(counts, 0).tolist()]
    assert counts[12] == 0 and counts[-1] == 0  # the lone H, the far H
    empty = neighbor_list(torch.tensor([[0.0, 0, 0], [0, 0, 9]]), 5.0)
    assert empty.num_edges == 0 and empty.row_ptr.tolist() == [0, 0, 0]


# -- segment sums -------------------------------------------------------------------------


@pytest.mark.parametrize("presorted", [True, False])
def test_gather_and_segment_sum_equal_index_ops_to_the_second_order(presorted):
    torch.manual_seed(0)
    n = 6
    index = torch.tensor([0, 0, 2, 2, 2, 3, 5])
    if not presorted:
        index = index[torch.randperm(index.numel())]
    seg = Segments.build(index, n, torch.tensor([0, 2, 2, 5, 6, 6, 7]) if presorted else None)
    x = torch.randn(n, 3, dtype=torch.float64, requires_grad=True)
    z = torch.randn(index.numel(), 3, dtype=torch.float64, requires_grad=True)
    assert torch.equal(gather(x, seg), x[index])
    ref = torch.zeros(n, 3, dtype=torch.float64).index_add(0, index, z)
    assert torch.allclose(segment_sum(z, seg), ref, rtol=0, atol=8 * torch.finfo(torch.float64).eps)
    assert segment_sum(z, seg)[[1, 4]].abs().max() == 0  # empty segments
    peak = segment_max(z, seg, initial=0.0)
    assert torch.equal(peak[1], torch.zeros(3)) and bool((peak >= 0).all())
    assert torch.autograd.gradcheck(lambda a: gather(a, seg), (x,))
    assert torch.autograd.gradgradcheck(lambda a: gather(a, seg) ** 2, (x,))
    assert torch.autograd.gradgradcheck(lambda b: segment_sum(b ** 2, seg), (z,))


def test_segment_sum_of_bf16_accumulates_in_fp32():
    seg = Segments.build(torch.zeros(256, dtype=torch.int64), 1)
    z = torch.full((256, 1), 1.0 + 2 ** -7, dtype=torch.bfloat16)  # exact in bf16
    assert segment_sum(z, seg).dtype == torch.bfloat16
    assert float(segment_sum(z, seg)) == 256 * (1.0 + 2 ** -7)  # bf16 steps of 2 at 256


# -- the model: torch segment sums vs the index_add reference ----------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("weights", ["silu", "softmax"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_csr_torch_path_matches_the_index_reference(weights, autocast):
    """Energies, forces (double backward) and parameter gradients: edge_kernel torch (CSR
    segment sums) against index (the earlier index_add_ path), fp32 and bf16 autocast,
    with a lone atom and atoms without edges in the batch."""
    b = mixed_batch()
    ref = run_model("index", weights, autocast, b)
    csr = run_model("torch", weights, autocast, b)
    dtype = torch.bfloat16 if autocast else torch.float32
    assert_energies_close(ref, csr, dtype)  # the network's part: no element references here
    for a, c in zip(ref[1:3], csr[1:3], strict=True):
        assert_close(a, c, dtype)
    assert float(ref[1][12].abs().max()) == 0  # the lone atom feels nothing
    assert float(ref[2].abs().sum()) > 0


def test_no_edges_at_all_gives_finite_energies_and_zero_network_forces():
    b = collate_records([atoms_to_record(Atoms("H", [[0, 0, 0]]), "h"),
                         atoms_to_record(Atoms("HO", [[0, 0, 0], [0, 0, 7.0]]), "ho")])
    for kernel in ("index", "torch"):
        e, f, grads, _ = run_model(kernel, "softmax", False, b)
        assert torch.isfinite(e).all() and float(f.abs().max()) == 0 and torch.isfinite(grads).all()


def test_compiled_blocks_match_eager_on_the_csr_path():
    """train.compile=blocks compiles each block; the CSR path's autograd Functions and
    segment_reduce trace (first order here: direct forces, no double backward, which
    torch.compile does not support): energies, forces and gradients as eager."""
    b = mixed_batch()
    out = []
    for compiled in (False, True):
        torch.manual_seed(0)
        m = build_model(ModelConfig(hidden=32, layers=2, heads=4, forces="direct",
                                    edge_kernel="torch"))
        if compiled:
            for blk in m.layers:
                blk.compile()
        try:
            e, f = m(b, with_forces=True)
            (e.sum() + (f * f).sum()).backward()
        finally:
            torch.compiler.reset()
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        out.append((e.detach(), f.detach(), grads))
    for a, c in zip(*out, strict=True):  # compiled kernels fuse: other roundings of fp32
        assert_close(a, c, torch.float32, k=64)


# -- the switch ---------------------------------------------------------------------------


def test_edge_kernel_switch_refusals_and_auto_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    b = mixed_batch()
    with pytest.raises(ConfigError, match="needs CUDA tensors") as err:
        run_model("triton", "silu", False, b, training=False)
    assert "model.edge_kernel=auto" in err.value.hint
    for bad in ({"vectors": True}, {"edge_chunk": 64}, {"attention": "topk"}):
        with pytest.raises(ValueError, match="triton needs"):
            ModelConfig(edge_kernel="triton", **bad)
    assert ModelConfig().edge_kernel == "auto"
    auto = run_model("auto", "silu", False, b, training=False)  # CPU: the torch path
    torch_ = run_model("torch", "silu", False, b, training=False)
    assert torch.equal(auto[0], torch_[0]) and torch.equal(auto[1], torch_[1])


@pytest.mark.numerics
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernels_under_the_interpreter():
    """tests/models/triton_interpreted.py in a process that sets TRITON_INTERPRET=1 before
    triton is imported (its tests skip elsewhere)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(Path(__file__).with_name("triton_interpreted.py"))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and " skipped" not in p.stdout, p.stdout[-2000:]
