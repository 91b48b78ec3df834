"""Inference compression: INT8 quantisation (:mod:`.quant`, :mod:`.qcheckpoint`).

Sits at the models layer: it imports only core utilities and :mod:`convergent.models`,
so the serving engine and the screening code use it without layering cycles.
"""
