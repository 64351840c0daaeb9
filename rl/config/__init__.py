"""The config tree (tree.py), how a recipe fills it (recipe.py), the cross-field rules that
its types cannot express (checks.py), and the registries of names its keys select
(registry.py). `from rl.config import Config` is the tree; the rest is imported by module.
"""

from rl.config.tree import (
    AgentConfig,
    AlgorithmConfig,
    BaseBuildConfig,
    CheckpointConfig,
    Config,
    CriticConfig,
    DataConfig,
    FaultsConfig,
    LoraConfig,
    ModelConfig,
    PartialRollout,
    RewardConfig,
    RewardTermConfig,
    RolloutConfig,
    RunConfig,
    SandboxConfig,
    SchedulerConfig,
    Section,
    TeacherConfig,
    TrainerConfig,
)

__all__ = [
    "AgentConfig",
    "AlgorithmConfig",
    "BaseBuildConfig",
    "CheckpointConfig",
    "Config",
    "CriticConfig",
    "DataConfig",
    "FaultsConfig",
    "LoraConfig",
    "ModelConfig",
    "PartialRollout",
    "RewardConfig",
    "RewardTermConfig",
    "RolloutConfig",
    "RunConfig",
    "SandboxConfig",
    "SchedulerConfig",
    "Section",
    "TeacherConfig",
    "TrainerConfig",
]
