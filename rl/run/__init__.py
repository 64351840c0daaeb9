"""A run: the driver (driver.py) builds the roles and hands the loop to the scheduler
(scheduler/); experience.py is a step's data flow from samples to an update, batching.py the
padded batch, evaluation.py held-out accuracy, preemption.py the signals, offline_eval.py
`rl eval` and `rl generate`."""
