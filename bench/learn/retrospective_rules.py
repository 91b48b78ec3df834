"""The rules of the retrospective active-learning bench (bench/learn/retrospective.py), fixed
before any seed runs.

:class:`Rules` is a frozen dataclass: the data split, the label budget and batches, the
committee and its training (the settings of ``convergent learn``'s members), and each
strategy's selection rules as a ``learn.select`` section. The bench writes it, with
:func:`rules_hash`, into the result JSON (and prints it) before the first campaign starts;
a changed rule is a changed hash. Presets: ``cpu`` (the whole run, 5 seeds x 4 strategies,
in about 37 minutes on 2 idle cores), ``gpu`` (the issue's ~2,000-label budget on one
CUDA GPU, bench/gpu/al.py) and ``smoke`` (minutes, to check the machinery).

The strategies:

* ``ours`` — what ``convergent learn`` does, with the rules of the prospective bench
  (bench/learn/active_learning.py's ``learn.select.*`` settings: greedy posterior
  acquisition on the committee's last layer x energy spread, one structure per compound a
  batch, no near-copy of a labelled structure);
* ``random`` — a seeded random batch (``learn.select.strategy: random``);
* ``spread_topk`` — the classic query by committee: the largest committee energy spread
  per atom first, no other rule;
* ``oracle`` — the ceiling: ours' rules, top-k by the committee's true energy error per atom
  (bench/learn/active_learning_ceiling.py's ``ORACLE``), read from the pool's labels by the
  score only (never counted as labels, never trained on).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from bench.learn.active_learning import SETTINGS as PROSPECTIVE
from bench.learn.active_learning_ceiling import ORACLE

STRATEGIES = ("ours", "random", "spread_topk", "oracle")
Pairs = tuple[tuple[str, Any], ...]


def _prospective_select() -> Pairs:
    """Ours' ``learn.select`` rules: the prospective bench's (one source for both benches)."""
    keep = {k.removeprefix("learn.select."): v for k, v in PROSPECTIVE.items()
            if k.startswith("learn.select.") and k != "learn.select.score_chunk"}
    return tuple(sorted({**keep, "strategy": "uncertainty"}.items()))


OURS = _prospective_select()
ORACLE_SELECT = tuple(sorted({**dict(OURS), **{k.removeprefix("learn.select."): v
                                               for k, v in ORACLE.items()}}.items()))
RANDOM = (("strategy", "random"),)
SPREAD_TOPK = tuple(sorted({"strategy": "uncertainty", "acquisition": "top", "force_weight": 0.0,
                            "diversity_tol": 0.0, "labelled_tol": 0.0,
                            "max_per_molecule": 0}.items()))


@dataclass(frozen=True)
class Rules:
    """Everything that decides a campaign's result (units: Å, eV; steps are optimizer steps)."""

    preset: str
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    strategies: tuple[str, ...] = STRATEGIES
    # the split (chemprop's balanced scaffold split): scaffold groups (bench/models/nci2k.py
    # scaffold_group) larger than half the held-out target go to the pool; the others,
    # shuffled with the campaign's seed, fill the held-out set to test_fraction of the
    # structures; the pool is the rest (nci2k's benzene group alone is 27% of it)
    test_fraction: float = 0.2
    test_structures: int = 400  # seeded sample of the held-out fold's structures (0: all)
    pool_compounds: int = 600  # seeded sample of the pool's compounds, all their structures (0: all)
    candidates: int = 1000  # seeded sample of the unlabelled pool scored per round (0: all)
    # labels: a seeded random init holding every element, then batches to the budget
    init: int = 40
    batch: int = 40
    budget: int = 400
    # the committee: members trained by train/fit.py (learn.tasks.train_member), each
    # warm-started from its previous-round self (learn does), element references refitted
    committee: int = 3
    first_round_steps: int = 300
    steps: int = 120
    warm_start: bool = True
    refit_reference: bool = True
    bootstrap: bool = False
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    cutoff: float = 5.0
    lr: float = 2e-3
    batch_atoms: int = 256
    # the molecular benches' weight (molbench_sides --force-weight): on 400 random nci2k
    # labels, 500 steps, 0.1 left the energy at the element-reference level (0.044 eV/atom,
    # 0.024 with 0.01; force MAE 0.30 vs 0.36 eV/A)
    force_weight: float = 0.01
    predict_batch_atoms: int = 1024  # scoring and evaluation batches
    device: str = "cpu"
    # selection (a learn.select section per strategy)
    ours: Pairs = OURS
    random: Pairs = RANDOM
    spread_topk: Pairs = SPREAD_TOPK
    oracle: Pairs = ORACLE_SELECT
    oracle_score: str = "|E_committee_mean - E_ref| / n_atoms (eV/atom)"

    def __post_init__(self) -> None:
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad or not self.strategies:
            raise ValueError(f"unknown strategies {bad} (known: {', '.join(STRATEGIES)})")
        if "random" not in self.strategies:
            raise ValueError("the statistic needs the random strategy")
        if not 0 < self.init <= self.budget or self.batch < 1 or self.committee < 2:
            raise ValueError("need 0 < init <= budget, batch >= 1 and a committee of 2 or more")
        if not 0 < self.test_fraction < 1 or self.device not in ("cpu", "cuda"):
            raise ValueError("need 0 < test_fraction < 1 and device cpu | cuda")
        for s in STRATEGIES:
            select_config(self, s)  # every strategy's rules are a valid learn.select section

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for s in STRATEGIES:
            d[s] = dict(d[s])
        return d


def rules_hash(rules: Rules) -> str:
    """A short hash of every rule (any change changes it)."""
    text = json.dumps(rules.to_dict(), sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def select_config(rules: Rules, strategy: str) -> Any:
    """The ``learn.select`` section of ``strategy`` under ``rules``."""
    from convergent.learn.config import SelectConfig

    return SelectConfig(**dict(getattr(rules, strategy)))


def base_config(rules: Rules) -> Any:
    """The config whose model and train sections every member starts from
    (learn.tasks.member_config adds the committee's fixed choices)."""
    from convergent.config import ConvergentConfig

    return ConvergentConfig.model_validate({
        "model": {"hidden": rules.hidden, "layers": rules.layers, "heads": rules.heads,
                  "cutoff": rules.cutoff},
        "train": {"lr": rules.lr, "batch_atoms": rules.batch_atoms,
                  "force_weight": rules.force_weight}})


PRESETS: dict[str, Rules] = {
    # 5 seeds x 4 strategies, 2 campaigns at a time on 2 cores: ~37 min when idle (seed 0
    # with steps=150 took 272 CPU-s for ours, 217 for random; the others lie between)
    "cpu": Rules(preset="cpu"),
    # the issue's ~2,000-label budget on one GPU (bench/gpu/al.py), every pool compound
    "gpu": Rules(preset="gpu", test_structures=2000, pool_compounds=0, candidates=3000,
                 init=200, batch=200, budget=2000, committee=3, first_round_steps=150,
                 steps=60, hidden=64, layers=3, batch_atoms=4096, predict_batch_atoms=16384,
                 device="cuda"),
    # minutes: the machinery, not a measurement
    "smoke": Rules(preset="smoke", seeds=(0, 1), test_structures=60, pool_compounds=200,
                   candidates=120, init=16, batch=16, budget=48, committee=2,
                   first_round_steps=20, steps=10, hidden=16, layers=1),
}
PROCESSES = {"cpu": 2, "gpu": 8, "smoke": 2}  # campaigns at a time (not a rule: no effect on results)


def with_overrides(rules: Rules, sets: list[str], seeds: list[int] | None) -> Rules:
    """``rules`` with ``--set name=value`` (a field's own type) and ``--seeds`` applied."""
    fields = {f.name: f for f in dataclasses.fields(Rules)}
    change: dict[str, Any] = {}
    for item in sets:
        name, _, value = item.partition("=")
        if name not in fields or name in STRATEGIES or name == "preset":
            raise ValueError(f"--set {item}: not a settable rule")
        current = getattr(rules, name)
        if isinstance(current, bool):
            change[name] = value.lower() in ("1", "true", "yes")
        elif isinstance(current, tuple):
            change[name] = tuple(type(current[0])(v) for v in value.split(","))
        else:
            change[name] = type(current)(value)
    if seeds is not None:
        change["seeds"] = tuple(seeds)
    return dataclasses.replace(rules, **change) if change else rules
