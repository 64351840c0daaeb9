"""What a run shows of itself: step metrics and where they go (metrics.py, console.py,
trackers.py), the timeline of work (trace.py, trace_plot.py), `rl report` (report.py), MFU
(flops.py), measured memory (memory.py) and the actors' log files (actor_logs.py)."""
