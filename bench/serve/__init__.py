"""Serving: offline throughput of the schedulers next to transformers' ``generate``
(:mod:`bench.serve.throughput`) and the multi-instance dispatcher
(:mod:`bench.serve.dispatch`)."""
