"""Active learning on one shared Dask pool: the surrogate chooses what to simulate next.

* :mod:`~convergent.learn.config` — ``LearnConfig`` (the ``learn`` section).
* :mod:`~convergent.learn.pool` — candidates, content keys, the pool and held-out set.
* :mod:`~convergent.learn.select` — disagreement score, near-duplicate rule, batch selection.
* :mod:`~convergent.learn.tasks` — the worker-side task kinds (train, score, explore, label, eval).
* :mod:`~convergent.learn.engine` — the shared pool: Dask priorities/resources, timeline.
* :mod:`~convergent.learn.label` — labelling a batch: provenance, quarantine, refill.
* :mod:`~convergent.learn.loop` — the driver: rounds, resume, stopping rules.
* :mod:`~convergent.learn.report` — learning curve, timeline, utilisation, round table.
"""
