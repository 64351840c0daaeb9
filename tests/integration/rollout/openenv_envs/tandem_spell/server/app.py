"""The environment's server: OpenEnv's FastAPI application around SpellEnvironment."""

from openenv.core.env_server.http_server import create_app

from ..models import SpellAction, SpellObservation
from .spell_environment import SpellEnvironment

app = create_app(
    SpellEnvironment,
    SpellAction,
    SpellObservation,
    env_name="tandem_spell",
    max_concurrent_envs=1,
)
