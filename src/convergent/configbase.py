"""Base class for every stage's pydantic config: unknown keys are errors, defaults work."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: extra keys forbidden, values validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())
