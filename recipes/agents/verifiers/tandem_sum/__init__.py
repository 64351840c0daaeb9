"""tandem_sum: a small verifiers environment (the `verifiers` package's v1 API) that
recipes/verifiers_sum_cpu.yaml trains on, offline. Each task asks for a sum of two numbers;
a wrong first answer gets a second try, the environment's user turn. The rubric: 1 for a
right last answer, 0.25 more for a right first one. Named
`verifiers:recipes/agents/verifiers/tandem_sum` (a local package, not installed); an
installed one would be `verifiers:tandem_sum`."""

from tandem_sum.env import SumEnv, SumTaskset

__all__ = ["SumEnv", "SumTaskset"]
