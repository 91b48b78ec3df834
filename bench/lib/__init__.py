"""What every benchmark shares: :mod:`bench.lib.harness` (sides, interleaved rounds, medians
with their spread, the result JSON), :mod:`bench.lib.load` (the load guard) and
:mod:`bench.lib.paths` (where results and data go; a child process's environment)."""
