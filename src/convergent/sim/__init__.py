"""Simulation: molecule sources, samplers, calculators and the Dask campaign."""

