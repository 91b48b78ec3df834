"""Base class for every stage's pydantic config: unknown keys are errors, defaults work.

It also names the bounded types every config field uses, so a count, size, rate or path
is checked when the config is loaded (``--set train.steps=0`` fails at once, naming
``train.steps``), never deep inside a stage:

``Count`` (>= 1), ``Count0`` (>= 0, 0 usually meaning "off"), ``Seed`` (0 .. 2**32-1),
``Positive``/``NonNegative`` (finite floats > 0 / >= 0), ``Fraction`` (0..1), ``Port``
(1..65535), ``PathStr`` (a non-empty path without NUL bytes), ``Name`` (a run name: one
path component), ``Endpoint`` (``host:port``) and ``Walltime`` (Slurm's time formats).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


class Section(BaseModel):
    """A config section: extra keys forbidden, values validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


def _path(value: str) -> str:
    if not value.strip():
        raise ValueError("must be a non-empty path")
    if "\x00" in value:
        raise ValueError("a path cannot contain a NUL byte")
    return value


def _name(value: str) -> str:
    _path(value)
    if "/" in value or "\\" in value or value in (".", ".."):
        raise ValueError("must be a single name (no '/', not '.' or '..'); use run.root for the folder")
    return value


def _endpoint(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError("must be host:port with a port in 1..65535")
    return value


_WALLTIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


def _walltime(value: str) -> str:
    if not _WALLTIME.match(value):
        raise ValueError("must be a Slurm time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS")
    return value


Count = Annotated[int, Field(ge=1)]
Count0 = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=0, lt=2**32)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Port = Annotated[int, Field(ge=1, le=65535)]
PathStr = Annotated[str, AfterValidator(_path)]
Name = Annotated[str, AfterValidator(_name)]
Endpoint = Annotated[str, AfterValidator(_endpoint)]
Walltime = Annotated[str, AfterValidator(_walltime)]
