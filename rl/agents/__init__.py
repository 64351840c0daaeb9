"""Multi-turn agents, the pieces so far: tool calls parsed from the model's output
(tool_calls.py); the token sequence of an episode built only by appending (trajectory.py); a
tool as a typed, documented Python function (tools.py: its schema for the chat template,
checking a call's arguments); tools run only in sandboxed worker processes (tool_pool.py,
tool_worker.py) and the built-in ones (builtin_tools.py: `python`, code execution). The
multi-turn loop that uses them is to come.
"""
