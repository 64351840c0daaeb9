"""The scheduler: the loop over futures (loop.py), what it is handed (ports.py), which step
each prompt group is for and when it may start (admission.py), a prompt group's bookkeeping
(prompt_groups.py), and the time-sliced handover of devices in colocate mode
(device_turns.py). It sees the workers only through its ports."""
