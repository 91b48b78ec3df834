"""Dataset analytics on Dask: ``data stats|dedup|filter|split|merge``.

Each command is a map over the shards of a committed dataset (one task per shard) on a
Dask cluster, streaming records; outputs are normal datasets written through per-worker
sinks (a few large shards per worker, one manifest commit, lineage in the manifest).

* :mod:`~convergent.analytics.engine`   tasks, per-worker sinks, locality, commit, lineage
* :mod:`~convergent.analytics.derived`  per-record derived values, hashes, fingerprint
* :mod:`~convergent.analytics.stats`    ``compute_stats``, ``write_stats`` (JSON + PNG)
* :mod:`~convergent.analytics.where`    ``--where`` expressions (ast whitelist)
* :mod:`~convergent.analytics.ops`      ``filter_dataset``, ``merge_datasets``
* :mod:`~convergent.analytics.dedup`    ``dedup_dataset``
* :mod:`~convergent.analytics.split`    ``split_dataset`` (random/molecule/scaffold/composition)
* :mod:`~convergent.analytics.groupkeys` string keys as xxh3-64 arrays (split's groups, leakage)
"""
