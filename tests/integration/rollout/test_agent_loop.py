"""AgentLoop with real parts: the PyTorch and vLLM engines in this process, a sandboxed
ToolPool with the built-in `python` tool, and a tiny Qwen2 with Qwen2.5's chat template
(tools in the system prompt, "tool" messages as <tool_response> blocks).

An untrained model writes no tool calls, so the episodes here run a scripted environment
(three_turns.py, a user's file run in its sandbox) that answers every turn (a tool result,
then a user's reply) until the third. The model's
end-of-turn token is made likely (tests.helpers.agent_engines.make_turns_short) so that its turns end by themselves
after a few tokens rather than at the token limit. Where a test needs a tool called, the
episode starts as a turn aborted mid-way that had written the call (rollout.agent_loop
resumes it like any partial sample).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pickle
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from rl.agents.env_pool import close_env_pools
from rl.agents.environment import Environment
from rl.agents.episode import start_group
from rl.agents.resolve import get_environment
from rl.agents.tool_pool import WORKER_GRACE_S, ToolPool
from rl.agents.trajectory import observation_ids
from rl.config import AgentConfig
from rl.types import NOT_SAMPLED, Sample, SamplingParams
from rollout.agent_loop import AgentLoop
from rollout.engine_loop import GenerationLoop
from rollout.engines.contract import RolloutEngine
from tests.helpers.agent_engines import (
    MAX_NEW_TOKENS,
    PARITY_TOL,
    TEMPERATURE,
    Engines,
    build_checkpoint,
    parity_gap,
)
from tests.helpers.processes import child_pids, marked_pids
from tests.helpers.waiting import HANG_GUARD_S, wait_until
from tests.integration.rollout.three_turns import NUM_TURNS

pytestmark = pytest.mark.integration

# A user's environment, run as users' are: in sandboxed workers, its state pickled with the
# sample (rl.agents.env_pool).
AGENT = AgentConfig(
    environment=f"{Path(__file__).with_name('three_turns.py')}:ThreeTurns",
    max_turns=NUM_TURNS + 1,
    tool_workers=2,
)
EXAMPLE = {"prompt": "What is 2+2? Use python."}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("agent-models")
    return {kind: build_checkpoint(root / kind, kind == "tied") for kind in ("untied", "tied")}


@pytest.fixture(scope="module")
def tokenizer(model_dirs: dict[str, Path]) -> PreTrainedTokenizerBase:
    """The checkpoints' tokenizer (both have the same), as the engines load it."""
    return AutoTokenizer.from_pretrained(model_dirs["untied"])


@pytest.fixture(scope="module")
def engines(model_dirs: dict[str, Path]) -> Iterator[Engines]:
    made = Engines(model_dirs)
    try:
        yield made
    finally:
        made.close()


def _three_turns() -> type[Environment]:
    """The environment's class here (its workers start with the first call)."""
    return get_environment(AGENT)


@pytest.fixture(scope="module")
def tools() -> Iterator[ToolPool]:
    with ToolPool.for_agent(AGENT) as pool:
        yield pool


@pytest.fixture(scope="module", autouse=True)
def no_workers_left() -> Iterator[None]:
    yield
    close_env_pools()
    for worker in (b"rl.agents.tool_worker", b"rl.agents.env_worker"):
        wait_until(lambda w=worker: not child_pids(w), "the sandboxes' workers exiting")


# -- what the engine sampled, piece by piece -------------------------------------------------


@dataclass
class Piece:
    """Tokens an engine appended to a sample in one generate call (a turn, or the part of it
    before an abort or after a resume)."""

    ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: str


Pieces = dict[tuple[int, int], list[Piece]]  # (group_id, index) -> in order


class Recording:
    """The engine as GenerationLoop sees it, recording what it appends to each sample and
    how many steps each running sample's current call has had."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self.pieces: Pieces = defaultdict(list)
        self.num_steps = 0
        self._running: dict[int, tuple[Sample, int, int]] = {}  # id -> sample, length, step

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    def start(self, samples: list[Sample], params: SamplingParams) -> None:
        self.engine.start(samples, params)
        for s in samples:
            self._running[id(s)] = (s, len(s.response_ids), self.num_steps)

    def step(self) -> list[Sample]:
        finished = self.engine.step()
        self.num_steps += 1
        self._record(finished)
        return finished

    def abort(self) -> list[Sample]:
        aborted = self.engine.abort()
        self._record(aborted)
        return aborted

    def mid_turn(self, min_steps: int) -> Sample | None:
        """A sample generating a turn after an observation, `min_steps` steps into it."""
        for sample, _, step in self._running.values():
            if sample.episode.num_turns >= 1 and self.num_steps - step >= min_steps:
                return sample
        return None

    def _record(self, samples: list[Sample]) -> None:
        for s in samples:
            _, start, _ = self._running.pop(id(s))
            assert set(s.token_versions[start:]) <= {self.engine.version}
            piece = Piece(
                s.response_ids[start:], s.logprobs[start:], self.engine.version, s.finish_reason
            )
            self.pieces[s.group_id, s.index].append(piece)


def _agent_loop(engine: Recording, tokenizer, tools: ToolPool, cfg: AgentConfig = AGENT):
    return AgentLoop(GenerationLoop(engine), tokenizer, cfg, tools)


def _groups(tokenizer, tools: ToolPool, num_groups: int, n: int) -> dict[int, list[Sample]]:
    return {
        g: start_group(_three_turns(), tokenizer, EXAMPLE, tools.schemas, n, g)
        for g in range(num_groups)
    }


async def _collect(loop: AgentLoop, keys: set[int]) -> dict[int, list[Sample]]:
    """Poll until every batch in `keys` is back."""
    back: dict[int, list[Sample]] = {}
    while set(back) != keys:
        back.update(await asyncio.wait_for(loop.poll(), HANG_GUARD_S))
    return back


def _run(loop: AgentLoop, batches: dict[int, list[Sample]], params: SamplingParams):
    async def run() -> dict[int, list[Sample]]:
        loop.start(batches, params)
        return await _collect(loop, set(batches))

    return asyncio.run(run())


def _samples(batches: dict[int, list[Sample]]) -> list[Sample]:
    return [s for key in sorted(batches) for s in batches[key]]


def _params(seed: int, n: int, max_new_tokens: int = MAX_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_new_tokens, n=n, temperature=TEMPERATURE, seed=seed)


# -- checks ------------------------------------------------------------------------------------


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def check_trajectory(tokenizer, sample: Sample, pieces: list[Piece]) -> list[list[int]]:
    """The sample holds its prompt, then, turn by turn, exactly the tokens the engine
    appended (`pieces`: a turn aborted and resumed is several) with their log-probs and
    versions, each followed by the observation's tokens as the chat template renders the
    episode's messages (log-prob 0.0, NOT_SAMPLED); the loss mask is 1 on the first, 0 on
    the second. Returns the turns' tokens."""
    episode = sample.episode
    messages, k = episode.messages, 1  # the environment's reset gave one message
    held = list(sample.prompt_ids)
    mask, logprobs, versions, turns = [], [], [], []
    pieces = list(pieces)
    assert pieces, "no turn generated"
    while pieces:
        turn = [pieces.pop(0)]
        while turn[-1].finish_reason == "abort" and pieces:
            turn.append(pieces.pop(0))
        ids = [t for piece in turn for t in piece.ids]
        held += ids
        mask += [1] * len(ids)
        logprobs += [lp for piece in turn for lp in piece.logprobs]
        versions += [piece.version for piece in turn for _ in piece.ids]
        if turn[-1].finish_reason == "abort":  # stopped mid-turn: no message for it yet
            assert sample.is_partial and k == len(messages)
            assert len(sample.loss_mask) == episode.turn_start == len(mask) - len(ids)
            mask = mask[: episode.turn_start]
            break
        turns.append(ids)
        ends_turn = ids[-1] in tokenizer.all_special_ids
        assert messages[k] == {
            "role": "assistant",
            "content": _decode(tokenizer, ids[:-1] if ends_turn else ids),
        }
        k += 1
        observation = []
        while k < len(messages) and messages[k]["role"] != "assistant":
            observation.append(messages[k])
            k += 1
        if observation:
            before = messages[: k - len(observation)]
            ids = observation_ids(tokenizer, held, before, observation, episode.tools)
            held += ids
            mask += [0] * len(ids)
            logprobs += [0.0] * len(ids)
            versions += [NOT_SAMPLED] * len(ids)
    assert k == len(messages)
    assert sample.prompt_ids + sample.response_ids == held
    assert sample.loss_mask == mask
    assert sample.logprobs == logprobs
    assert sample.token_versions == versions
    assert episode.turn_start == len(sample.loss_mask)
    return turns


def _complete(sample: Sample, errors: dict[str, int] | None = None) -> None:
    """A finished episode of NUM_TURNS turns, with these tool errors (default none)."""
    assert sample.finish_reason == "stop", sample.finish_reason
    assert sample.episode.num_turns == NUM_TURNS
    assert sample.episode.errors == (errors or {})
    assert sample.response_text == sample.episode.answer
    assert sample.policy_version == 0


# -- 1. log-prob parity over turns -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["untied", "tied"])
@pytest.mark.parametrize("engine_name", ["torch", "vllm"])
def test_multi_turn_logprobs_match_transformers_and_observations_are_inserted(
    engines: Engines, tokenizer, tools: ToolPool, engine_name: str, kind: str
) -> None:
    engine = Recording(engines.shared(engine_name, kind))
    batches = _groups(tokenizer, tools, num_groups=2, n=2)
    back = _run(_agent_loop(engine, tokenizer, tools), batches, _params(seed=3, n=2))

    assert back == batches
    model = AutoModelForCausalLM.from_pretrained(engines.model_dirs[kind])
    turns = []
    for sample in _samples(back):
        _complete(sample)
        assert sample.episode.reward == 0.5 + 0.0 + 1.0  # the tool result, the reply, the end
        assert [m["role"] for m in sample.episode.messages] == [
            "user",
            "assistant",
            "tool",
            "assistant",
            "user",
            "assistant",
        ]
        turns += check_trajectory(tokenizer, sample, engine.pieces[sample.group_id, sample.index])
        assert 0 < sum(sample.loss_mask) < len(sample.response_ids)
        assert parity_gap(model, sample) < PARITY_TOL
        if engine_name == "vllm":  # a turn is a request holding the history, mostly cached
            mask = sample.loss_mask
            starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
            assert len(starts) == NUM_TURNS
            turn_prompts = sum(len(sample.prompt_ids) + start for start in starts)
            assert sample.request_prompt_tokens == turn_prompts
            assert 0 < sample.cached_prompt_tokens <= turn_prompts
        else:
            assert sample.cached_prompt_tokens is None
    # Re-encoding some turns' text gives other tokens (splits BPE would not make, broken
    # UTF-8, ids the tokenizer lacks): the checks above would catch a loop that re-encoded.
    assert any(
        tokenizer(_decode(tokenizer, t), add_special_tokens=False)["input_ids"] != t for t in turns
    )


# -- 2. stopped mid-turn, resumed here or on another worker ---------------------------------

TURN_TOKENS = 3  # how far into a turn after an observation it stops (at least, interrupted)


def _abort_point(samples: list[Sample]) -> int:
    """A `stop_every` that stops some sample TURN_TOKENS tokens into its second turn (and
    none before its first observation)."""
    for sample in samples:
        mask = sample.loss_mask
        starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
        if len(starts) >= 2 and sum(mask[starts[1] :]) > TURN_TOKENS:
            return starts[1] + TURN_TOKENS
    raise AssertionError("no episode has a second turn long enough to stop in")


@pytest.mark.parametrize(
    "engine_name, how",
    [("torch", "abort point"), ("vllm", "abort point"), ("torch", "interrupt")],
)
def test_a_turn_stopped_mid_way_comes_back_partial_and_resumes_on_any_worker(
    engines: Engines, tokenizer, tools: ToolPool, engine_name: str, how: str
) -> None:
    """Stopped at an abort point (`stop_every`), or by an interrupt once a turn after an
    observation is TURN_TOKENS steps in. Seeds (SamplingParams.seed_of) move on with the
    response length at every generate call, a resumed turn's included, so a resumed episode
    need not end as the uninterrupted one. What a seeded run guarantees: the same tokens as
    the uninterrupted run up to the stop, the same episodes for those that finished before
    it, and a resumption that gives the same tokens on whichever worker resumes it."""
    params = _params(seed=11, n=2)
    engine = Recording(engines.shared(engine_name, "untied"))
    uninterrupted = _samples(
        _run(_agent_loop(engine, tokenizer, tools), _groups(tokenizer, tools, 2, 2), params)
    )
    stop_every = _abort_point(uninterrupted)

    batches = _groups(tokenizer, tools, 2, 2)
    engine = Recording(engine.engine)
    loop = _agent_loop(engine, tokenizer, tools)
    partial: dict[int, list[Sample]] = {}
    at_interrupt: dict[tuple[int, int], Sample] = {}  # copies of the partial samples
    pieces_at_interrupt: dict[tuple[int, int], int] = {}

    async def stopped_then_resumed() -> None:
        if how == "abort point":
            loop.start(batches, dataclasses.replace(params, stop_every=stop_every))
        else:
            loop.start(batches, params)
            deadline = time.monotonic() + HANG_GUARD_S
            while engine.mid_turn(TURN_TOKENS) is None:
                assert time.monotonic() < deadline, "no turn after an observation ran long enough"
                await asyncio.sleep(0)
            assert loop.interrupt() >= 1
        assert await _collect(loop, set(batches)) == batches
        for key, samples in batches.items():
            if kept := [s for s in samples if s.is_partial]:
                partial[key] = kept
        at_interrupt.update(
            ((s.group_id, s.index), s) for s in pickle.loads(pickle.dumps(_samples(partial)))
        )
        # One stopped TURN_TOKENS (interrupted: at least) into a turn after an observation.
        assert any(
            s.episode.num_turns >= 1 and len(s.response_ids) - s.episode.turn_start >= TURN_TOKENS
            for s in at_interrupt.values()
        )
        if how == "abort point":  # each stopped exactly at one
            assert all(len(s.response_ids) % stop_every == 0 for s in at_interrupt.values())
        pieces_at_interrupt.update((key, len(pieces)) for key, pieces in engine.pieces.items())
        # Resumed as the driver resumes them: the partial samples only.
        loop.start(partial, params)
        assert await _collect(loop, set(partial)) == partial

    asyncio.run(stopped_then_resumed())

    # Another worker resumes a copy (samples cross workers pickled): a fresh engine, as if
    # synced to version 1 of the same weights, and a fresh tool pool.
    elsewhere = pickle.loads(pickle.dumps(at_interrupt))
    other = Recording(engines.fresh(engine_name, "untied"))
    other.engine.version = 1
    with ToolPool.for_agent(AGENT) as pool:
        copies = {key: [s for s in elsewhere.values() if s.group_id == key] for key in partial}
        _run(_agent_loop(other, tokenizer, pool), copies, params)

    model = AutoModelForCausalLM.from_pretrained(engines.model_dirs["untied"])
    for sample, whole in zip(_samples(batches), uninterrupted, strict=True):
        key = (sample.group_id, sample.index)
        _complete(sample)
        check_trajectory(tokenizer, sample, engine.pieces[key])
        assert parity_gap(model, sample) < PARITY_TOL
        if key not in at_interrupt:  # finished before the abort point
            assert sample.response_ids == whole.response_ids
            assert sample.logprobs == pytest.approx(whole.logprobs, abs=1e-6)
            continue
        stopped = at_interrupt[key]
        length = len(stopped.response_ids)
        assert stopped.finish_reason == "abort"
        assert stopped.episode.num_turns < NUM_TURNS
        assert len(stopped.loss_mask) == stopped.episode.turn_start <= length
        assert stopped.response_ids == whole.response_ids[:length]
        assert stopped.logprobs == pytest.approx(whole.logprobs[:length], abs=1e-6)
        assert sample.response_ids[:length] == stopped.response_ids

        copy = elsewhere[key]
        _complete(copy)
        before = engine.pieces[key][: pieces_at_interrupt[key]]
        check_trajectory(tokenizer, copy, before + other.pieces[key])
        assert copy.response_ids == sample.response_ids
        assert copy.loss_mask == sample.loss_mask
        assert copy.logprobs == pytest.approx(sample.logprobs, abs=1e-6)
        assert copy.episode.messages == sample.episode.messages
        # The tokens sampled before the abort point keep version 0, the later ones carry 1.
        assert copy.token_versions[:length] == stopped.token_versions
        resumed = [v for v, m in zip(copy.token_versions, copy.loss_mask, strict=True) if m][
            sum(stopped.loss_mask) + length - len(stopped.loss_mask) :
        ]
        assert resumed and set(resumed) == {1}
        assert copy.policy_version == 0


# -- 3. a hung tool holds up its own episode only ----------------------------------------------

TOOL_TIMEOUT_S = 4.0
SLOW_TOOLS = '''
import time


def hang(marker: str) -> str:
    """Name this process `marker` (the host sees a sandbox's processes under other pids), then
    sleep far past any timeout.

    Args:
        marker: A name of at most 15 characters.
    """
    with open("/proc/self/comm", "w") as f:
        f.write(marker)
    time.sleep(1000)
    return "woke up"
'''


@pytest.fixture
def slow_tools(tmp_path: Path) -> str:
    """A user's tool file: its schema and its calls come from the tool workers."""
    (tmp_path / "agent_slow_tools.py").write_text(SLOW_TOOLS)
    return f"{tmp_path / 'agent_slow_tools.py'}:hang"


def _calling(tokenizer, sample: Sample, *calls: tuple[str, dict]) -> Piece:
    """Make `sample` a first turn aborted just after it wrote `calls` (name, arguments), which
    the engine resumes from there; returns those tokens, which no engine sampled."""
    text = "".join(
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
        for name, arguments in calls
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    sample.response_ids = list(ids)
    sample.logprobs = [-1.0] * len(ids)
    sample.token_versions = [0] * len(ids)
    sample.finish_reason = "abort"
    return Piece(list(ids), [-1.0] * len(ids), 0, "abort")


def test_a_hung_tool_times_out_without_holding_up_the_other_episodes(
    engines: Engines, tokenizer, slow_tools: str
) -> None:
    """Episode 0's first turn calls the hanging tool, then python (reporting the monotonic
    clock when it runs); episodes 1 and 2 call python only."""
    cfg = AGENT.model_copy(
        update={"tools": [slow_tools], "tool_timeout_s": TOOL_TIMEOUT_S, "tool_workers": 3}
    )
    marker = f"hang-{uuid.uuid4().hex[:10]}"
    engine = Recording(engines.shared("torch", "untied"))
    with ToolPool.for_agent(cfg) as pool:
        batches = {
            g: start_group(_three_turns(), tokenizer, EXAMPLE, pool.schemas, 1, g) for g in range(3)
        }
        clock = {"code": "import time\ntime.monotonic()"}
        prefilled = {
            0: _calling(tokenizer, batches[0][0], ("hang", {"marker": marker}), ("python", clock)),
            **{
                g: _calling(tokenizer, batches[g][0], ("python", {"code": f"print({g} * 21)"}))
                for g in (1, 2)
            },
        }
        loop = _agent_loop(engine, tokenizer, pool, cfg)
        start = time.monotonic()

        async def run() -> dict[int, float]:
            loop.start(batches, _params(seed=5, n=1, max_new_tokens=400))  # calls are long
            back: dict[int, float] = {}
            while len(back) < len(batches):
                for key in await asyncio.wait_for(loop.poll(), HANG_GUARD_S):
                    back[key] = time.monotonic() - start
            return back

        seconds = asyncio.run(run())

    assert max(seconds[1], seconds[2]) < min(seconds[0], TOOL_TIMEOUT_S)
    assert TOOL_TIMEOUT_S <= seconds[0] < TOOL_TIMEOUT_S + WORKER_GRACE_S
    hung = batches[0][0]
    _complete(hung, errors={"timeout": 1})
    assert hung.episode.num_calls == 2
    timeout, clock_result = hung.episode.messages[2:4]
    assert (timeout["role"], timeout["name"]) == ("tool", "hang")
    assert timeout["content"].startswith("Timeout:")
    assert hung.episode.tool_seconds >= TOOL_TIMEOUT_S
    # The call after the hung one in the same turn ran at once, not after the timeout.
    assert (clock_result["role"], clock_result["name"]) == ("tool", "python")
    assert float(clock_result["content"]) - start < TOOL_TIMEOUT_S
    for g in (1, 2):
        sample = batches[g][0]
        _complete(sample)
        assert sample.episode.messages[2] == {
            "role": "tool",
            "name": "python",
            "content": f"{g * 21}\n",
        }
    for g, [sample] in batches.items():
        check_trajectory(tokenizer, sample, [prefilled[g], *engine.pieces[g, 0]])
    # The hung call's process was killed at the timeout, not left sleeping.
    assert not marked_pids(marker)
