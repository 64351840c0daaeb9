"""Multi-turn agents' tools: a tool is a typed, documented Python function (tools.py: its
schema for the chat template, checking a call's arguments, naming it), run only in the
sandboxed worker processes of `ToolPool` (tool_pool.py, tool_worker.py); builtin_tools.py holds
the built-in ones (`python`, code execution). The multi-turn loop that calls them is to come.
"""
