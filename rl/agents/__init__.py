"""Multi-turn agents: tool calls parsed from the model's output (tool_calls.py) and the
token sequence of an episode built only by appending (trajectory.py)."""
