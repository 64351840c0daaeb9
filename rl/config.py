"""The one typed config tree. A recipe YAML fills it; `key=value` overrides patch it.

Every field has a single definition here with a one-line description, which is what
`rl train --help-config` prints. Unknown keys are errors (extra="forbid").
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    path: str = Field(
        description="Local Hugging Face causal-LM directory (config, safetensors, tokenizer)."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Parameter dtype for trainer and rollout."
    )


class BaseBuildConfig(_Section):
    """The tiny pretrained checkpoint the CPU recipes build for themselves (`rl build-base`)."""

    build_if_missing: bool = Field(
        False, description="Build an SFT base at model.path when it does not exist."
    )
    vocab_size: int = Field(
        288,
        description="Target BPE vocabulary size (byte-level, so never below 260 tokens).",
    )
    hidden_size: int = Field(128, description="Qwen2 hidden size.")
    num_layers: int = Field(4, description="Qwen2 decoder layers.")
    num_heads: int = Field(
        4,
        description="Attention heads (head_dim = hidden_size / num_heads, at least 32 for vLLM CPU).",
    )
    num_kv_heads: int = Field(2, description="Key/value heads (grouped-query attention).")
    intermediate_size: int = Field(384, description="MLP width.")
    tie_word_embeddings: bool = Field(
        False, description="Share input embedding and lm_head weights."
    )
    sft_steps: int = Field(
        1500, description="Most supervised fine-tuning steps on the task's train split."
    )
    sft_batch_size: int = Field(64, description="Sequences per SFT step.")
    sft_lr: float = Field(2e-3, description="Peak SFT learning rate (cosine decay, short warmup).")
    sft_target_accuracy: float = Field(
        0.3,
        description="Stop SFT once greedy accuracy on train examples held out from SFT reaches "
        "this (0 = run all sft_steps); leaves RL headroom.",
    )


class DataConfig(_Section):
    task: str = Field("addition", description="Task name from rl.tasks (addition, countdown).")
    dir: str = Field(
        ".cache/data", description="Where generated train/test jsonl splits are written and read."
    )
    num_train: int = Field(20000, description="Generated train prompts.")
    num_test: int = Field(500, description="Generated held-out prompts.")
    num_digits: int = Field(3, description="Addition: digits per operand.")
    num_operands: int = Field(3, description="Countdown: numbers given (3 or 4).")
    seed: int = Field(
        1234, description="Seed of the task generator (splits are disjoint and deterministic)."
    )


class RolloutConfig(_Section):
    engine: Literal["vllm"] = Field("vllm", description="Rollout engine.")
    num_workers: int = Field(1, description="RolloutWorker actors, one engine each.")
    tensor_parallel_size: int = Field(1, description="vLLM tensor parallelism inside each worker.")
    kv_cache_gb: float = Field(
        1.0, description="vLLM CPU KV-cache size per worker in GiB (never vLLM's all-RAM default)."
    )
    gpu_memory_utilization: float = Field(
        0.4, description="vLLM GPU memory fraction per worker (GPU only)."
    )
    max_model_len: int = Field(256, description="Longest prompt+response the engine accepts.")
    max_new_tokens: int = Field(16, description="Response length cap.")
    temperature: float = Field(
        1.0, description="Sampling temperature (also used for trainer log-probs)."
    )
    top_p: float = Field(1.0, description="Nucleus sampling threshold.")
    weight_bucket_mb: int = Field(64, description="Weight-sync bucket size in MiB.")


class TrainerConfig(_Section):
    num_workers: int = Field(
        2, description="TrainWorker actors in one torch.distributed group (FSDP2 ranks)."
    )
    lr: float = Field(1e-5, description="AdamW learning rate (constant after warmup).")
    warmup_steps: int = Field(0, description="Linear LR warmup optimizer steps.")
    weight_decay: float = Field(0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, description="Global gradient-norm clip.")
    micro_batch_size: int = Field(32, description="Sequences per forward/backward on one rank.")
    num_mini_batches: int = Field(1, description="Optimizer steps per rollout batch per epoch.")
    num_epochs: int = Field(1, description="Passes over each rollout batch.")
    logprob_chunk_size: int = Field(
        1024, description="Tokens per chunk in the fused log-prob kernel."
    )
    num_threads: int = Field(1, description="torch intra-op threads per trainer rank on CPU.")


class AlgorithmConfig(_Section):
    name: Literal["grpo"] = Field("grpo", description="RL algorithm.")
    group_size: int = Field(8, description="Responses sampled per prompt (G).")
    advantage: str = Field("grpo", description="Advantage estimator from rl.algorithms.ADVANTAGES.")
    normalize_std: bool = Field(True, description="Divide group-centred rewards by the group std.")
    policy_loss: str = Field("clipped", description="Policy loss from rl.algorithms.POLICY_LOSSES.")
    clip_low: float = Field(0.2, description="PPO ratio clip below 1.")
    clip_high: float = Field(
        0.2, description="PPO ratio clip above 1 (clip-higher when > clip_low)."
    )
    loss_agg: str = Field(
        "token_mean", description="Loss aggregation from rl.algorithms.LOSS_AGGREGATIONS."
    )
    kl_coef: float = Field(
        0.0, description="Weight of the KL penalty to the frozen reference (0 = no reference)."
    )
    kl_estimator: str = Field("k3", description="KL estimator from rl.algorithms.KL_ESTIMATORS.")
    entropy_coef: float = Field(0.0, description="Entropy bonus weight.")


class RunConfig(_Section):
    name: str = Field("run", description="Run name (directory under output_dir, wandb run name).")
    output_dir: str = Field("runs", description="Parent of run directories.")
    seed: int = Field(0, description="Seed for prompt order, sampling and initialisation.")
    num_steps: int = Field(20, description="RL steps (generate, score, train, sync).")
    prompts_per_step: int = Field(
        32, description="Prompts per step; each gets group_size responses."
    )
    eval_every: int = Field(
        10, description="Evaluate held-out greedy accuracy every N steps (0 = start/end only)."
    )
    num_eval_prompts: int = Field(200, description="Held-out prompts per evaluation.")
    export_hf: bool = Field(
        True, description="Export the final policy as an HF checkpoint in the run directory."
    )
    wandb_mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="wandb mode."
    )
    wandb_project: str = Field("tandem", description="wandb project.")
    progress_bar: bool = Field(True, description="Show a progress bar on the console.")


class Config(_Section):
    model: ModelConfig
    base: BaseBuildConfig = BaseBuildConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    run: RunConfig = RunConfig()
