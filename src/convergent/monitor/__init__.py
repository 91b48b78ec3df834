"""Monitoring: timers, FLOPs/MFU, metric sinks, the report."""

