"""Configuration of the video family (engine block of a profile). Owned by video/; extend freely."""

from pydantic import BaseModel, ConfigDict


class VideoConfig(BaseModel):
    """Engine config of the Wan-style video family (placeholder until the video engine lands)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
