"""Configuration of the speech family (engine block of a profile). Owned by audio/; extend freely."""

from pydantic import BaseModel, ConfigDict


class TTSConfig(BaseModel):
    """Engine config of the Orpheus-style speech family (placeholder until the speech engine lands)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
