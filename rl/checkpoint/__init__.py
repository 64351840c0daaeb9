"""Checkpoints: directories on disk with atomic writes and manifests (store.py), a whole run's
state (run_state.py), which checkpoint a run continues from (resume.py), and `rl export`
(export.py). The trainer's own shards are written by trainer/checkpoint.py."""
