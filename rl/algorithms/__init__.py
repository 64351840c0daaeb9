"""RL algorithms as pure functions over tensors, each kind in its own module with its
registry: advantages, policy losses, KL estimators, off-policy corrections, loss
aggregations, the critic's value loss, and objective.py, the policy objective composed from
them. A new algorithm is one registered function in the module of its kind."""
