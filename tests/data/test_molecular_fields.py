"""`molecular_fields` / `ShardReader.fields`: the label scan's partial decode agrees with
the full decode, with and without forces, and with meta that only the stdlib reads."""

from __future__ import annotations

import math

import numpy as np
import pytest


def _rec(key: str, n: int, forces: bool, meta: dict) -> dict:
    rng = np.random.default_rng(len(key) + n)
    rec = {"key": key, "molecule_id": f"m-{key}", "numbers": rng.integers(1, 9, n),
           "positions": rng.normal(size=(n, 3)), "energy": float(rng.normal()), "meta": meta}
    if forces:
        rec["forces"] = rng.normal(size=(n, 3))
    return rec


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_fields_match_the_full_decode(tmp_path, compression):
    from convergent.data.reader import open_dataset
    from convergent.data.writer import write_records

    recs = [_rec("a", 5, True, {"round": 1, "sampler": "md", "origin": "g2:x"}),
            _rec("bb", 3, False, {}),
            _rec("ccc", 7, True, {"wall_s": float("nan"), "round": [1, 2]})]  # NaN: not JSON proper
    write_records(tmp_path / "ds", recs, compression=compression)
    ds = open_dataset(tmp_path / "ds")
    try:
        (rd,) = ds.shards
        for i in range(len(ds)):
            full, part = rd.record(i), rd.fields(i)
            np.testing.assert_array_equal(part.numbers, full["numbers"])
            assert part.energy == full["energy"]
            if np.isfinite(full["forces"]).all():
                np.testing.assert_array_equal(part.forces, full["forces"])
            else:
                assert part.forces is None
            assert part.meta.keys() == full["meta"].keys()
            for k, v in full["meta"].items():
                assert (isinstance(v, float) and math.isnan(v) and math.isnan(part.meta[k])) or part.meta[k] == v
    finally:
        ds.close()
