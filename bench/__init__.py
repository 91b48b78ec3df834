"""The benchmarks, one package per area, run from the checkout's root as modules:
``python -m bench.<area>.<name>`` (``python -m bench.train.throughput --help``).

bench/lib holds what every bench shares (the harness, the load guard, the paths); results
go to bench/results/ (tracked), generated data to bench/data/ (git-ignored). A bench
imports its neighbours by their package path (``from bench.lib.harness import Side``),
never by editing ``sys.path``."""
