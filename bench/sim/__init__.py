"""Simulation throughput: a serial GFN2-xTB loop against the Dask campaign
(:mod:`bench.sim.throughput`)."""
