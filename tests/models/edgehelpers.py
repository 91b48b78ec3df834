"""Shared pieces of the edge-kernel tests (CPU, Triton interpreter, CUDA)."""

from __future__ import annotations

import torch
from ase import Atoms
from ase.build import molecule

from convergent.models.batching import atoms_to_record, collate_records
from convergent.models.config import ModelConfig
from convergent.models.molecular import build_model, energy_and_forces
from convergent.models.segments import Segments

EPS = {dt: torch.finfo(dt).eps for dt in (torch.float32, torch.bfloat16, torch.float16)}


def mixed_batch(dtype: torch.dtype = torch.float32, small: bool = False):
    """Benzene, a lone atom (index 12), ethanol and two H atoms 9 Å apart (no edges
    within 5 Å; the last two atoms); ``small``: water, the lone atom (index 3), methane
    and the far pair (for Triton's interpreter, which runs every program in Python)."""
    first, third = ("H2O", "CH4") if small else ("C6H6", "CH3CH2OH")
    recs = [atoms_to_record(molecule(first), "a"), atoms_to_record(Atoms("H", [[0, 0, 0]]), "h"),
            atoms_to_record(molecule(third), "c"),
            atoms_to_record(Atoms("HH", [[0, 0, 0], [0, 0, 9.0]]), "far")]
    return collate_records(recs, dtype=dtype)


def run_model(kernel: str, weights: str, autocast: bool, batch, training: bool = True,
              device: str = "cpu", **cfg):
    """Energies, forces, the parameter gradients of ``sum E + sum F²`` (training, in train
    mode: through the double backward; else None, in eval mode) and the per-atom energies,
    of a seeded small model."""
    torch.manual_seed(0)
    m = build_model(ModelConfig(hidden=cfg.pop("hidden", 32), layers=2, heads=cfg.pop("heads", 4),
                                attention_weights=weights, edge_kernel=kernel, **cfg)).to(device)
    m.train(training)  # eval mode for inference, as the calculator runs it
    batch = batch.to(device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        e, f = energy_and_forces(m, batch, training=training)
        with torch.no_grad():
            _, atom_e = m(batch, per_atom=True)
    if not training:
        return e, f, None, atom_e
    (e.sum() + (f * f).sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
    return e.detach(), f.detach(), grads, atom_e


def assert_close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, k: float = 4.0) -> None:
    """|a - b| <= k eps(dtype) max|a|: two paths agree to a few roundings of ``dtype``."""
    a, b = a.detach(), b.detach()
    err = float((a.double() - b.double()).abs().max())
    tol = k * EPS[dtype] * float(a.abs().max())
    assert err <= tol, f"max |a - b| = {err:.3g} > {k} eps({dtype}) max|a| = {tol:.3g}"


def assert_energies_close(ref, other, dtype: torch.dtype, k: float = 4.0) -> None:
    """Energies within k eps(dtype) of the network's part (the sum of |per-atom energy|)."""
    err = float((ref[0] - other[0]).abs().max())
    tol = k * EPS[dtype] * float(ref[3].abs().sum())
    assert err <= tol, f"energies: {err:.3g} > {tol:.3g}"


def edge_features(dtype: torch.dtype, sorted_recv: bool = True, seed: int = 0,
                  device: str = "cpu"):
    """A small edge list with empty segments and one longer than a kernel block; ``qkv``,
    ``fe``, ``env`` float64 holding ``dtype``-exact values (the reference computes on the
    very inputs the kernel sees)."""
    g = torch.Generator().manual_seed(seed)
    n, heads, d = 7, 2, 20  # d not a power of two: the masked lanes are exercised
    deg = torch.tensor([3, 0, 19, 1, 5, 0, 2])  # 19 > the kernel's 16 edges a step
    src = torch.arange(n).repeat_interleave(deg)
    dst = torch.randint(0, n, (src.numel(),), generator=g)
    ptr = None
    if sorted_recv:
        ptr = torch.nn.functional.pad(torch.cumsum(deg, 0), (1, 0)).to(device)
    else:
        perm = torch.randperm(src.numel(), generator=g)
        src, dst = src[perm], dst[perm]
    recv = Segments.build(src.to(device), n, ptr)
    send = Segments.build(dst.to(device), n)
    qkv = (torch.randn(n, 3 * heads * d, generator=g) * 0.5).to(dtype).double().to(device)
    fe = torch.randn(src.numel(), heads + heads * d, generator=g).to(dtype).double().to(device)
    env = torch.rand(src.numel(), generator=g).to(dtype).double().to(device)
    return qkv, fe, env, recv, send, heads
