"""The environment's action and observation, OpenEnv's pydantic models."""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class SpellAction(Action):
    message: str = Field(..., description="What the speaker says")


class SpellObservation(Observation):
    prompt: str = Field(default="", description="What the speaker is asked to say")
