"""Prompts and answers: the train/test splits and the prompt stream (loading.py), prompt text
to token ids (prompts.py), and generated or file-backed tasks (tasks/, one file a task)."""
