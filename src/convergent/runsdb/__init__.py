"""Run directories and their records: writing them, reading them back, comparing, costing.

``rundir`` (``RunDir``, ``open_run``: the run directory and its stage bookkeeping),
``trainrecords`` (the typed ``train_step``/``val`` lines of metrics.jsonl), ``accounting``
(core/GPU-seconds per stage, ours and Slurm's), ``records`` (the typed JSONL records and the last-attempt rule), ``usage`` (what a stage
held and for how long), ``index`` (one summary per run), ``compare`` (config diff,
metrics side by side, curves), ``cost`` (core/GPU-seconds per stage, pluggable sources),
``remove`` (deleting a run). ``convergent runs ...`` is a thin layer over these.
"""
