"""Quarantine: frames and inputs that could not be labelled, with their reason.

``<dataset>/quarantine.jsonl`` is append-only, one JSON object per line
(``key, molecule_id, reason, time, host`` + extras); each append is fsynced and a torn
last line is ignored on reading, so a killed driver loses nothing already quarantined.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from convergent.core.fsutil import dumps_json
from convergent.sim.molecules import InputRejection

QUARANTINE_NAME = "quarantine.jsonl"

_HOST = socket.gethostname()


def quarantine_entry(key: str, molecule_id: str, reason: str, **extra: Any) -> dict[str, Any]:
    """One quarantine line: the frame's key, its molecule, why, when (s since epoch), where."""
    return {"key": key, "molecule_id": molecule_id, "reason": reason, "time": time.time(),
            "host": _HOST, **extra}



class QuarantineLog:
    """Append-only JSONL of quarantined frames/inputs; fsynced per append; torn lines ignored."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def keys(self) -> set[str]:
        return {e["key"] for e in self.entries() if "key" in e}

    def entries(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
        return out

    def append(self, entries: Iterable[dict[str, Any]]) -> int:
        lines = [dumps_json(e, default=str) + "\n" for e in entries]
        if not lines:
            return 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.writelines(lines)
            fh.flush()
            os.fsync(fh.fileno())
        return len(lines)



def log_rejections(qlog: QuarantineLog, rejected: list[InputRejection]) -> None:
    """Quarantine malformed inputs (key ``input:<file>:<line>``) not already logged."""
    known = qlog.keys()
    qlog.append(
        quarantine_entry(f"input:{r.where}", "", r.reason, kind="InputError")
        for r in rejected if f"input:{r.where}" not in known
    )
