"""The colocated placement plan: bundles per role and the share each actor asks for."""

from __future__ import annotations

from rl.config import Config
from rl.placement import plan_placement


def _config(**sections: dict) -> Config:
    return Config.model_validate({"model": {"path": "m"}, **sections})


def test_grpo_plans_rollout_and_trainer_on_a_shared_pool() -> None:
    plan = plan_placement(_config(trainer={"num_workers": 2}, rollout={"num_workers": 1}))
    assert plan.num_devices == 2
    assert plan.roles == {"rollout": [0], "trainer": [0, 1]}
    assert plan.num_roles_sharing == 2


def test_tensor_parallel_rollout_workers_start_on_their_first_device() -> None:
    plan = plan_placement(
        _config(trainer={"num_workers": 2}, rollout={"num_workers": 2, "tensor_parallel_size": 2})
    )
    assert plan.num_devices == 4
    assert plan.roles["rollout"] == [0, 2]


def test_ppo_adds_a_critic_group_and_reward_models_share_bundle_zero(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    plan = plan_placement(
        _config(
            algorithm={"advantage": "gae"},
            critic={"num_workers": 1},
            reward={"terms": [{"name": f"model:{tmp_path}"}, {"name": f"model:{tmp_path}"}]},
        )
    )
    assert plan.roles["critic"] == [0]
    assert plan.roles["reward_model"] == [0, 0]
    # Bundle 0 holds rollout, trainer rank 0, the critic and two reward models.
    assert plan.num_roles_sharing == 5
    assert "critic: 1 actor(s) on bundles [0]" in plan.describe()


def test_split_gives_rollout_and_trainer_disjoint_devices(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    plan = plan_placement(
        _config(
            scheduler={"placement": "split", "trainer_devices": 1},
            trainer={"num_workers": 2},
            algorithm={"advantage": "gae"},
            critic={"num_workers": 2},
            reward={"terms": [{"name": f"model:{tmp_path}"}]},
        )
    )
    assert plan.num_devices == 2
    assert plan.roles == {
        "rollout": [0],
        "trainer": [1, 1],
        "critic": [1, 1],
        "reward_model": [1],
    }
    assert plan.trace_lanes() == {"rollout-0": [0], "trainer": [1], "reward": [1]}
    assert plan.describe().startswith("split: 2 devices")


def test_split_spreads_tensor_parallel_workers_over_their_devices() -> None:
    plan = plan_placement(
        _config(
            scheduler={"placement": "split", "rollout_devices": 4},
            rollout={"num_workers": 2, "tensor_parallel_size": 2},
            trainer={"num_workers": 2},
        )
    )
    assert plan.roles == {"rollout": [0, 2], "trainer": [4, 5]}
    assert plan.num_devices == 6
    lanes = plan.trace_lanes()
    assert lanes["rollout-1"] == [2, 3] and lanes["trainer"] == [4, 5]
