"""A tiny verifiers environment (the `verifiers` package's v1 API) for Tandem's tests, run
offline: two turns per episode, the second a user turn the environment sends after the
model's first reply, scored by a rubric of two weighted rewards of the replies. Named
`verifiers:tests/integration/rollout/verifiers_envs/tandem_echo` (a local package, not
installed); test_ecosystem_envs.py computes its rewards itself from the served replies."""

from tandem_echo.env import EchoEnv, EchoTaskset

__all__ = ["EchoEnv", "EchoTaskset"]
