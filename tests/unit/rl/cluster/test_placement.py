"""The colocated placement plan: bundles per role and the share each actor asks for."""

from __future__ import annotations

from rl.cluster.placement import plan_placement
from rl.config import Config


def _config(**sections: dict) -> Config:
    return Config.model_validate({"model": {"path": "m"}, **sections})


def test_grpo_plans_rollout_and_trainer_on_a_shared_pool() -> None:
    plan = plan_placement(_config(trainer={"num_workers": 2}, rollout={"num_workers": 1}))
    assert plan.num_devices == 2
    assert plan.roles == {"rollout": [0], "trainer": [0, 1]}
    assert plan.num_roles_sharing == 2


def test_a_time_sliced_rollout_worker_gets_threads_for_its_node_blocks_devices() -> None:
    one = plan_placement(_config(trainer={"num_workers": 2}, rollout={"num_workers": 1}))
    assert one.rollout_threads(0) == 2  # it shares bundle 0 with a trainer rank
    two = plan_placement(_config(trainer={"num_workers": 4}, rollout={"num_workers": 2}))
    assert [two.rollout_threads(i) for i in range(2)] == [2, 2]
    nodes = plan_placement(
        _config(
            trainer={"num_workers": 8},
            rollout={"num_workers": 2},
            scheduler={"devices_per_node": 4},
        )
    )
    assert [nodes.rollout_threads(i) for i in range(2)] == [2, 2]  # both in the first node


def test_num_devices_widens_the_colocated_pool_for_one_trainer_rank() -> None:
    cfg = _config(trainer={"num_workers": 1}, rollout={"num_workers": 1})
    assert plan_placement(cfg).rollout_threads(0) == 1  # a pool of one bundle: a CPU idles
    cfg.scheduler.num_devices = 2
    plan = plan_placement(cfg)
    assert plan.num_devices == 2 and plan.node_blocks == [[0, 1]]
    assert plan.roles == {"rollout": [0], "trainer": [0]}
    assert plan.rollout_threads(0) == 2


def test_tensor_parallel_rollout_workers_start_on_their_first_device() -> None:
    plan = plan_placement(
        _config(trainer={"num_workers": 2}, rollout={"num_workers": 2, "tensor_parallel_size": 2})
    )
    assert plan.num_devices == 4
    assert plan.roles["rollout"] == [0, 2]
    assert [plan.rollout_bundles(i) for i in range(2)] == [[0, 1], [2, 3]]
    # --dry-run names each engine's ranks and the bundles whose devices they get.
    description = plan.describe()
    assert "rollout engine 0: tensor-parallel ranks 0-1 on the devices of bundles [0, 1]" in (
        description
    )
    assert "rollout engine 1: tensor-parallel ranks 0-1 on the devices of bundles [2, 3]" in (
        description
    )


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


def test_without_devices_per_node_each_pool_is_one_node_group() -> None:
    colocated = plan_placement(_config(trainer={"num_workers": 2}))
    assert colocated.node_blocks == [[0, 1]]
    split = plan_placement(_config(scheduler={"placement": "split"}, trainer={"num_workers": 2}))
    # Rollout and trainer devices are reserved apart: either may land on its own node.
    assert split.node_blocks == [[0], [1, 2]]


def test_devices_per_node_cuts_each_pool_into_node_blocks_that_keep_tp_groups_whole() -> None:
    plan = plan_placement(
        _config(
            scheduler={"devices_per_node": 4},
            rollout={"num_workers": 4, "tensor_parallel_size": 2},
            trainer={"num_workers": 8},
        )
    )
    assert plan.node_blocks == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan.roles["rollout"] == [0, 2, 4, 6]
    # Every engine's TP ranks sit in one node block, and bundles are found by node.
    for first in plan.roles["rollout"]:
        assert plan.locate(first)[0] == plan.locate(first + 1)[0]
    assert plan.locate(6) == (1, 2)
    assert "node blocks (each packed on one node): [0, 1, 2, 3] [4, 5, 6, 7]" in plan.describe()

    split = plan_placement(
        _config(
            scheduler={"placement": "split", "devices_per_node": 2},
            rollout={"num_workers": 3},
            trainer={"num_workers": 2},
        )
    )
    assert split.node_blocks == [[0, 1], [2], [3, 4]]


def test_a_distillation_teacher_is_a_group_of_its_own_on_the_trainers_devices() -> None:
    teacher = {"path": "t"}
    plan = plan_placement(_config(trainer={"num_workers": 2}, teacher=teacher))
    assert plan.roles == {"rollout": [0], "trainer": [0, 1], "teacher": [0, 1]}
    assert plan.num_roles_sharing == 3 and plan.node_blocks == [[0, 1]]
    assert plan.trace_lanes()["trainer"] == [0, 1]
    # More teacher ranks than trainer ranks widen the colocated pool, as a critic's would.
    wide = plan_placement(
        _config(trainer={"num_workers": 2}, teacher={**teacher, "num_workers": 4})
    )
    assert wide.roles["teacher"] == [0, 1, 2, 3] and wide.num_devices == 4
    split = plan_placement(
        _config(trainer={"num_workers": 2}, teacher=teacher, scheduler={"placement": "split"})
    )
    assert split.roles == {"rollout": [0], "trainer": [1, 2], "teacher": [1, 2]}
    assert split.num_devices == 3


def test_split_gives_a_teacher_with_devices_its_own_pool_after_the_trainers() -> None:
    plan = plan_placement(
        _config(
            trainer={"num_workers": 2},
            teacher={"path": "t", "num_workers": 2, "devices": 2},
            scheduler={"placement": "split", "devices_per_node": 4},
        )
    )
    assert plan.roles == {"rollout": [0], "trainer": [1, 2], "teacher": [3, 4]}
    assert plan.num_devices == 5 and plan.num_roles_sharing == 1
    assert plan.node_blocks == [[0], [1, 2], [3, 4]]
    assert plan.trace_lanes()["trainer"] == [1, 2, 3, 4]
    assert "teacher: 2 actor(s) on bundles [3, 4]" in plan.describe()
