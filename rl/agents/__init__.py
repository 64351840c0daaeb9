"""Multi-turn agents (docs/agents.md): environments (environment.py; users' run in sandboxed
workers, env_pool.py; resolve.py: the environment class and tools an agent set-up names); how
a group of episodes starts and what happens between two turns (episode.py; an episode's state
is rl.types.Episode, carried by its sample); the token sequence of an episode built only by
appending (trajectory.py); tool calls parsed from the model's output (tool_calls.py); a tool
as a typed, documented Python function (tools.py: its schema for the chat template, checking a
call's arguments); tools run only in sandboxed worker processes (tool_pool.py, tool_worker.py)
and the built-in ones (builtin_tools.py: `python`, code execution). The loop that runs
episodes on an engine is rollout/agent_loop.py.
"""
