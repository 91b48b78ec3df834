"""Atomic file writes: write to a temporary name in the same directory, fsync, rename.

A reader never sees a half-written file; a crash leaves either the old file or the new
one. Used for configs, manifests, shards, checkpoints metadata and reports.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def _umask() -> int:
    """The process umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a plain ``open()`` would give a new file: ``0o666`` minus the umask
    (``tempfile.mkstemp`` makes 0600, which a shared group could not read)."""
    return 0o666 & ~_umask()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it is durable (no-op where unsupported)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of the range's dirty pages, no wait
_SFR: Any = None  # libc's sync_file_range once looked up; False where there is none


def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux) via ctypes, or None where there is none."""
    global _SFR
    if _SFR is None:
        _SFR = False
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            f = ctypes.CDLL(None, use_errno=True).sync_file_range
            f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            _SFR = f
    return _SFR or None


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` of ``fd`` to disk now,
    without waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; a no-op elsewhere).

    A large file written and then fsynced otherwise waits for all of it at the fsync;
    started as it is written, the disk writes overlap the work that produces the data and
    the final fsync has little left to do. Not a durability guarantee (fsync still is)."""
    f = _sync_file_range()
    if f is not None and nbytes > 0:
        f(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # errors ignored: only a hint


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO]:
    """Open a temporary sibling of ``path`` for writing; on success fsync and rename it.

    On an exception the temporary file is removed and ``path`` is left untouched.
    """
    if "w" not in mode:
        raise ValueError("atomic_open is for writing ('w' or 'wb')")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, file_mode())  # mkstemp makes 0600; use the usual file mode
        with os.fdopen(fd, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path, "wb") as fh:
        fh.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[dict]:
    """The JSON objects of a JSON-lines file, in order; a missing file yields nothing.

    Blank lines, lines that are not JSON objects and a torn last line (after a crash
    mid-append) are skipped, so a reader never fails on a file a writer is appending to.
    """
    p = Path(path)
    if not p.exists():
        return
    with p.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                yield row


# -- strict JSON ------------------------------------------------------------------------
# Every JSON file the project writes is strict (RFC 8259): no NaN or Infinity, which
# strict parsers reject. The one convention: a non-finite number becomes ``null`` and,
# inside an object, a sibling ``<key>_null_reason`` says why (the caller's reason when
# it gave one in ``reasons``, else "not a number" / "infinite").


def _reason(x: float) -> str:
    return "not a number (NaN)" if x != x else "infinite"


def strict_json(obj: Any, reasons: dict[str, str] | None = None) -> Any:
    """``obj`` with every non-finite float replaced by None (objects gain
    ``<key>_null_reason``; ``reasons`` maps a key to its reason, at any depth)."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        out: dict[Any, Any] = {}
        for k, v in obj.items():
            out[k] = strict_json(v, reasons)
            if isinstance(v, float) and out[k] is None and f"{k}_null_reason" not in obj:
                out[f"{k}_null_reason"] = (reasons or {}).get(str(k), _reason(v))
        return out
    if isinstance(obj, list | tuple):
        return [strict_json(v, reasons) for v in obj]
    return obj


def dumps_json(obj: Any, reasons: dict[str, str] | None = None, **kwargs: Any) -> str:
    """Strict JSON text of ``obj`` (see :func:`strict_json`); ``allow_nan=False``, so a
    non-finite number that escaped the conversion (e.g. in a ``default=`` result) fails
    loudly instead of writing ``NaN``."""
    if not reasons:
        try:  # the common case, all finite: one C-speed pass
            return json.dumps(obj, allow_nan=False, **kwargs)
        except ValueError:
            pass
    return json.dumps(strict_json(obj, reasons), allow_nan=False, **kwargs)


def loads_strict(text: str) -> Any:
    """Parse JSON as strict parsers do: ``NaN``/``Infinity`` raise ValueError."""
    def refuse(name: str) -> Any:
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)
