"""Dataset analytics: ``stats``, ``dedup`` and ``split`` on Dask against one process, a
plain dask.bag peer and the machine's ceiling (:mod:`bench.analytics.commands`; the peer in
:mod:`bench.analytics.naive`)."""
