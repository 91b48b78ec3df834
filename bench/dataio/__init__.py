"""Reading datasets: loose files against convergent's shards and the peers' formats
(:mod:`bench.dataio.read`; OS-level measurements in :mod:`bench.dataio.read_os`, the systems
in :mod:`bench.dataio.read_systems`). Not ``bench/data``: that folder holds the benches'
generated datasets (git-ignored)."""
