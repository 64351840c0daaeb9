"""Where roles run: the placement plan (placement.py), its per-rank memory estimate
(memory_plan.py), the Ray reservation (reservation.py), and the driver's handles to each
role's actors (rollout_workers.py, trainer_ranks.py, critic_ranks.py)."""
