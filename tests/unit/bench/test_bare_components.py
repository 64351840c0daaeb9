"""bench/bare_components.py gives Tandem's actors the CPUs the bare side gets."""

from __future__ import annotations

from rl.config.recipe import load_config
from tests.unit.bench.bench_modules import load_bench_module

bare_components = load_bench_module("bare_components")


def test_whole_machine_gives_the_rollout_engine_every_cpu_at_one_trainer_rank():
    # At W = 1 the recipe's own pool is one bundle: the engine would get one thread while
    # the bare engine gets two (what once read as a 60% overhead).
    cfg = load_config(bare_components.RECIPE, ["trainer.num_workers=1"])
    machine = bare_components.WholeMachine(cfg, num_cpus=2)
    assert machine.plan.rollout_threads(0) == 2
    assert machine.actor_options(0, num_roles_sharing=3) == {"num_cpus": 2}
