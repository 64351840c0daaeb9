"""Say a word, twice: the reset asks for a word (chosen by the reset's seed), the first step
earns half the share of the word's distinct letters in the message and asks once more, the
second earns 1 if the message holds the word and ends the episode."""

from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from ..models import SpellAction, SpellObservation

WORDS = ("apple", "river", "stone", "cloud", "ember", "maple")


class SpellEnvironment(Environment):
    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._word = WORDS[0]

    def reset(self, seed=None, episode_id=None, **kwargs) -> SpellObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._word = WORDS[(seed or 0) % len(WORDS)]
        return SpellObservation(prompt=f"Say the word {self._word}.", done=False, reward=0.0)

    def step(self, action: SpellAction, timeout_s=None, **kwargs) -> SpellObservation:
        self._state.step_count += 1
        said = action.message.lower()
        if self._state.step_count == 1:
            share = len(set(self._word) & set(said)) / len(set(self._word))
            prompt = f"Say it once more: {self._word}"
            return SpellObservation(prompt=prompt, done=False, reward=0.5 * share)
        return SpellObservation(prompt="", done=True, reward=float(self._word in said))

    @property
    def state(self) -> State:
        return self._state
