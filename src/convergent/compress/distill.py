"""Knowledge distillation of a surrogate committee into one student (teacher outputs as
training targets).

:func:`teacher_dataset` runs the committee (the models of an active-learning round,
:mod:`convergent.learn`, or any saved surrogates) over a dataset's structures, and, with
``augment > 0``, over that many randomly displaced copies of each (Gaussian, ``sigma`` Å:
the unlabelled neighbourhood where a teacher adds information the labels lack), and
writes a normal dataset store whose ``energy``/``forces`` are the committee **mean**
(eV, eV/Å). The student is then an ordinary run of the training engine on it::

    convergent train -s train.dataset=<teacher set> -s train.val_dataset=<real labels> \
        -s model.hidden=32 -s model.layers=1

so it is saved as a normal checkpoint (``ckpt/final``) that ``screen``/``learn`` load.
The returned :class:`TeacherSet` names the teachers (record it with the student).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from convergent.core.errors import InputError

__all__ = ["TeacherSet", "committee_predict", "kd_loss", "teacher_dataset"]


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
            temperature: float, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed (over tokens) distillation loss of a language model and its summed hard CE.

    ``(1 - alpha) * CE(targets) + alpha * T^2 * KL(softmax(t/T) || softmax(s/T))``
    (Hinton et al. 2015): the ``T^2`` keeps the soft term's gradient on the scale of the
    hard one's for any ``T``. Logits ``[..., V]`` of the same positions and vocabulary
    (the teacher's prediction for the same next token); ``targets`` ``[...]``.
    """
    if student_logits.shape != teacher_logits.shape:
        raise InputError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ (same tokenizer and positions needed)")
    v = student_logits.shape[-1]
    s = student_logits.float().reshape(-1, v)
    t = teacher_logits.detach().float().reshape(-1, v)
    ce = torch.nn.functional.cross_entropy(s, targets.reshape(-1), reduction="sum")
    kl = torch.nn.functional.kl_div(torch.log_softmax(s / temperature, -1),
                                    torch.log_softmax(t / temperature, -1),
                                    log_target=True, reduction="sum")
    return (1 - alpha) * ce + alpha * temperature * temperature * kl, ce


@dataclass
class TeacherSet:
    """What :func:`teacher_dataset` wrote."""

    path: Path
    structures: int
    teachers: list[str]
    energy_std_mean: float  # mean committee spread of the energies (eV): the teachers' disagreement


def committee_predict(models: Sequence[torch.nn.Module], records: list[dict],
                      batch_atoms: int = 2048) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """Committee-mean energies [S] (eV), forces (one [N_s, 3] array each, eV/Å) and the
    energy spread (std over members, eV) of ``records``."""
    from convergent.models.batching import batches_by_atom_budget, collate_records
    from convergent.models.molecular import energy_and_forces

    counts = [len(r["numbers"]) for r in records]
    energies = np.zeros((len(models), len(records)))
    forces = [np.zeros((len(models), c, 3)) for c in counts]
    for idx in batches_by_atom_budget(counts, batch_atoms):
        batch = collate_records([records[i] for i in idx])
        offs = np.cumsum([0] + [counts[i] for i in idx])
        for m, model in enumerate(models):
            e, f = energy_and_forces(model, batch, False)
            e, f = e.double().numpy(), f.double().numpy()
            for j, i in enumerate(idx):
                energies[m, i] = e[j]
                forces[i][m] = f[offs[j]:offs[j + 1]]
    spread = energies.std(0, ddof=1) if len(models) > 1 else np.zeros(len(records))
    return energies.mean(0), [f.mean(0) for f in forces], spread


def teacher_dataset(
    teacher_dirs: Sequence[str | Path],
    dataset: str | Path,
    out: str | Path,
    augment: int = 0,
    sigma: float = 0.05,
    seed: int = 0,
    batch_atoms: int = 2048,
) -> TeacherSet:
    """Write the committee-labelled dataset of ``dataset``'s structures (see the module
    doc); the original labels are not used."""
    from convergent.data.reader import open_dataset
    from convergent.data.writer import write_records
    from convergent.models.io import load_model

    if not teacher_dirs:
        raise InputError("no teacher model given", hint="pass the committee's model directories")
    if not 0.0 <= sigma <= 1.0 or not 0 <= augment <= 100:
        raise InputError(f"sigma={sigma} (0..1 Å) and augment={augment} (0..100) out of bounds")
    models = [load_model(d, "cpu")[0] for d in teacher_dirs]
    ds = open_dataset(dataset)
    try:
        base = [ds[i] for i in range(len(ds))]
    finally:
        ds.close()
    rng = np.random.default_rng(seed)
    records = []
    for r in base:
        pos = np.asarray(r["positions"], np.float64)
        for k in range(augment + 1):
            p = pos if k == 0 else pos + rng.normal(0.0, sigma, pos.shape)
            records.append({"key": f"{r['key']}~{k}" if k else str(r["key"]),
                            "molecule_id": r.get("molecule_id", "") or "",
                            "numbers": np.asarray(r["numbers"], np.int64), "positions": p})
    energy, forces, spread = committee_predict(models, records, batch_atoms)
    for r, e, f in zip(records, energy, forces, strict=True):
        r["energy"] = float(e)
        r["forces"] = f
    write_records(Path(out), records, compression="none")
    return TeacherSet(Path(out), len(records), [str(d) for d in teacher_dirs], float(spread.mean()))
