"""Weight sync, trainer -> rollout: the transfer plan (plan.py), the transports (transport.py:
the channel contract and the registry; one file per transport; selection.py: which one a run
gets), the process group (gloo or NCCL) for transports across hosts (peer_group.py,
pieces.py), and the driver's side of a sync (weight_sync.py). The sending side lives in
trainer/, the receiving side in rollout/."""
