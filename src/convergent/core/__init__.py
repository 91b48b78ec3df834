"""The lowest layer: what every other package may use and which imports nothing of theirs.

``errors`` (the project error type, exit code 2 for bad input), ``fsutil`` (atomic writes,
strict JSON), ``configbase`` (the pydantic base of every config section), ``provenance``
(commit, versions, host), ``elements`` (the periodic table subset and masses), ``xyzfile``
(xyz/extxyz read and validated line by line).
"""
