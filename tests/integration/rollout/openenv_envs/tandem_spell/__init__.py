"""An OpenEnv environment laid out as `openenv init` makes one (models.py, server/app.py), for
tests/integration/rollout/test_ecosystem_envs.py: `openenv:tests/integration/rollout/openenv_envs/
tandem_spell` (a local package, not installed). The test computes its rewards itself from the
replies the endpoint served."""
