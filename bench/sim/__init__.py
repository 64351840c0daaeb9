"""A simulated cluster behind the real scheduler's ports (bench/simulate.py, docs/scale.md):
a clock that jumps from event to event (`clock`), what each kind of work costs on a GPU
(`costs`), response lengths (`lengths`), continuously batching rollout engines (`engine`),
the trainer, scorer and run that tie them to `rl.run.scheduler.loop` (`cluster`), and verl's
published fully-async experiment as the calibration anchor (`verl`)."""
