"""Rollout engines: the contract every engine meets (contract.py), the registry
`rollout.engine` selects from (registry.py), and one file per engine."""
