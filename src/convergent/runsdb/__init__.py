"""Reading run directories back: typed metric records, listing, comparing, costing.

``records`` (the typed JSONL records and the last-attempt rule), ``usage`` (what a stage
held and for how long), ``index`` (one summary per run), ``compare`` (config diff,
metrics side by side, curves), ``cost`` (core/GPU-seconds per stage, pluggable sources),
``remove`` (deleting a run). ``convergent runs ...`` is a thin layer over these.
"""
