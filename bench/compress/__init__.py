"""Inference compression with its quality cost: the Llama and the molecular surrogate
(:mod:`bench.compress.inference`; the surrogate half in :mod:`bench.compress.surrogate`)."""
