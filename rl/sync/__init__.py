"""Weight sync, trainer -> rollout: the transfer plan (plan.py), the transports (transport.py:
the channel contract and the registry; one file per transport), the gloo group for
transports across hosts (gloo_group.py, pieces.py), and the driver's side of a sync
(weight_sync.py). The sending side lives in trainer/, the receiving side in rollout/."""
