"""The one typed config tree. A recipe YAML fills it (rl.config.recipe); `key=value`
overrides patch it.

Every field has a single definition here with a one-line description, which is what
`rl train --help-config` prints. Unknown keys are errors (extra="forbid"). The sections go
from the run level (where roles run, how far generation runs ahead, saving, faults, length and
reporting) to the model, data, rollout, trainer, algorithm, critic, teacher and reward
sections, and `Config`, the root.
"""

from __future__ import annotations

import fnmatch
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# What a weight sync does to the generations in flight (scheduler.partial_rollout).
PartialRollout = Literal["finish", "abort", "interrupt", "carry"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SchedulerConfig(Section):
    """Where roles run on the device pool, and how far generation may run ahead of training."""

    placement: Literal["colocate", "split"] = Field(
        "colocate",
        description="colocate: every role shares every device, time-sliced; split: rollout and "
        "trainer get disjoint devices.",
    )
    rollout_devices: int = Field(
        0,
        description="split: devices for the rollout workers (0 = rollout.num_workers x "
        "tensor_parallel_size).",
    )
    trainer_devices: int = Field(
        0,
        description="split: devices the trainer ranks (and critic, reward models) share "
        "(0 = trainer.num_workers).",
    )
    num_devices: int = Field(
        0,
        ge=0,
        description="colocate: devices (bundles) of the shared pool (0 = as many as the largest "
        "role needs); more give a time-sliced CPU rollout engine more threads, e.g. 2 with one "
        "trainer rank on a 2-CPU machine (set trainer.num_threads to match).",
    )
    devices_per_node: int = Field(
        0,
        ge=0,
        description="Devices each node gives the run: every pool (colocate: the whole pool; "
        "split: rollout's and trainer's) is reserved in groups of at most this many, each packed "
        "on one node (0 = each pool on one node).",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="k: a trained sample's oldest token is at most k policy versions old; 0 = "
        "on-policy, k >= 1 generates the next steps while the trainer trains.",
    )
    partial_rollout: PartialRollout = Field(
        "finish",
        description="k >= 1: a sample generated for a later step than the next finishes under "
        "the policy version it started with (finish), or stops every abort_every tokens "
        "(abort) or wherever it is when a weight sync comes due (interrupt: the sync never "
        "waits, but runs are not reproducible) and resumes under the next version with its "
        "prefix kept. carry: groups belong to no step until they finish; every sample stops "
        "every abort_every tokens, and each step trains the first groups to finish counted in "
        "generated tokens, within max_token_age and max_stale_share (docs/scale.md).",
    )
    max_token_age: int = Field(
        4,
        ge=0,
        description="partial_rollout carry: no trained token is more than this many policy "
        "versions old; a group that would be older is dropped (carry/dropped_groups).",
    )
    max_stale_share: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="partial_rollout carry: at most this share of a step's trained tokens are "
        "more than max_staleness versions old (verl's staleness_threshold).",
    )
    groups_in_flight: int = Field(
        0,
        ge=0,
        description="partial_rollout carry: prompt groups generating or finished and waiting "
        "for a step, kept topped up at every epoch (0 = 2 x run.prompts_per_step).",
    )
    streaming: bool = Field(
        False,
        description="Train a step chunk by chunk (stream_groups) as its groups finish "
        "(old/reference log-probs, values, forward and backward), and take the optimizer step "
        "once the last is in: the trainer works while the step's tail generates; gradients "
        "are summed exactly, so the order chunks finish in does not matter (docs/scale.md, "
        "'Streaming trainer').",
    )
    stream_groups: int = Field(
        0,
        ge=0,
        description="streaming: groups a chunk holds; a step's chunks are consecutive runs of "
        "its groups by id, each trained once all its groups are scored. Smaller chunks start "
        "training earlier; each costs a forward/backward pass on every trainer rank (0 = enough "
        "for one micro-batch on every rank: trainer.num_workers x micro_batch_size sequences).",
    )
    abort_every: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="partial_rollout abort and carry: the response tokens such a sample "
        "generates under one policy version before it waits for the next (a deterministic "
        "abort point). auto: a percentile of the response lengths of the step last synced "
        "(rollout.max_new_tokens until the first sync): under abort the 95th, so that only the "
        "long tail stops (docs/scale.md, 'Abort points'); under carry the 50th, an epoch about "
        "a typical response long (docs/scale.md, 'Carry-over').",
    )

    @property
    def time_sliced(self) -> bool:
        """Roles take turns on the same devices: colocated and on-policy (k = 0)."""
        return self.placement == "colocate" and self.max_staleness == 0

    @property
    def keeps_pushed_weights(self) -> bool:
        """Generation runs while the trainer trains (k >= 1), so each trainer rank keeps a
        host copy of the rows it last pushed: a rollout worker lost meanwhile is replaced on
        the version the rollout serves, and the run stays exact. It costs host memory for one
        more copy of the trained parameters, split over the ranks."""
        return self.max_staleness >= 1


def stream_groups(configured: int, trainer: TrainerConfig, group_size: int) -> int:
    """scheduler.stream_groups, where 0 means a micro-batch of sequences on every trainer
    rank: fewer would leave ranks computing padding rows for nothing."""
    return configured or math.ceil(trainer.num_workers * trainer.micro_batch_size / group_size)


def groups_in_flight(configured: int, groups_per_step: int) -> int:
    """scheduler.groups_in_flight, where 0 means twice the groups a step trains."""
    return configured or 2 * groups_per_step


class RunConfig(Section):
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
    num_eval_prompts: int = Field(
        200,
        description="Held-out prompts per evaluation (0 = no evaluation: no eval/accuracy, "
        "eval_every ignored).",
    )
    export_hf: bool = Field(
        True, description="Export the final policy as an HF checkpoint in the run directory."
    )
    log_format: Literal["progress", "json"] = Field(
        "progress",
        description="Console output: progress (a live display of step i/N, ETA, the running "
        "phases and key numbers on a terminal; a line a step elsewhere), or json (each step's "
        "record and each message as one JSON object a line, for machines).",
    )
    verbose: bool = Field(
        False,
        description="Stream Ray's and vLLM's worker output to the console; otherwise each actor "
        "writes to runs/NAME/logs/ROLE.log.",
    )
    wandb_mode: Literal["auto", "offline", "online", "disabled"] = Field(
        "auto",
        description="wandb: auto = online when this machine has wandb credentials "
        "(WANDB_API_KEY or `wandb login`), else offline under the run directory; a WANDB_MODE "
        "environment variable wins over auto.",
    )
    wandb_project: str = Field("tandem", description="wandb project.")
    tensorboard: bool = Field(
        True, description="Also write the step metrics as tensorboard scalars (RUN/tensorboard)."
    )

    def directory(self) -> Path:
        """Where the run writes everything: output_dir/name."""
        return Path(self.output_dir) / self.name


class CheckpointConfig(Section):
    """Checkpoints that continue a run exactly (`rl train RECIPE --resume auto|PATH`)."""

    every: int = Field(
        500,
        description="Write a checkpoint every N steps (as Hugging Face's Trainer saves), so a "
        "fault restart loses at most N steps; 0 = only at the end and on preemption.",
    )
    keep_last: int = Field(2, description="Checkpoints kept in run_dir/checkpoints (>= 1).")
    save_final: bool = Field(True, description="Write a checkpoint after the last step.")


class FaultsConfig(Section):
    """How many failures a run absorbs before it stops, loudly."""

    max_trainer_restarts: int = Field(
        2,
        description="A trainer or critic rank that dies: rebuild every role from the last "
        "checkpoint, at most this many times per run.",
    )
    max_rollout_restarts: int = Field(
        3,
        description="A rollout worker that dies: restart it on the current weights and "
        "regenerate its prompts, at most this many times per run.",
    )
    reward_model_retries: int = Field(
        2, description="A reward-model actor that dies: restart it and retry a call this often."
    )
    max_nonfinite_steps: int = Field(
        3,
        description="Steps with a NaN/inf loss or gradient are skipped; this many in a row "
        "stop the run with a checkpoint of the last good state.",
    )


class LoraConfig(Section):
    """LoRA adapters (peft) trained instead of the whole model, over the frozen base; off
    while `rank` is 0 (docs/lora.md)."""

    rank: int = Field(0, description="Adapter rank r; 0 = train the whole model.")
    alpha: float = Field(
        16.0, description="Adapter scale numerator: the update is (alpha / rank) * B @ A."
    )
    dropout: float = Field(
        0.0,
        description="Dropout on each adapter's input in the trainer's training forward "
        "(peft's lora_dropout); log-probs are recomputed and sampled without it.",
    )
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Names of the linear modules that get an adapter (the last part of the "
        "module name, as peft matches them).",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def peft_dict(self) -> dict:
        """The adapter's settings as PEFT's adapter_config.json holds them."""
        return {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": self.target_modules,
        }

    def peft_config(self) -> object:
        """The same adapters as peft's `LoraConfig`, which the trainer and the torch engine
        apply (`get_peft_model`). Their dropout acts only where a module is in training mode:
        the trainer's training forward (`trainer.fsdp.adapter_dropout`)."""
        from peft import LoraConfig as PeftLoraConfig

        return PeftLoraConfig(**self.peft_dict())


class ModelConfig(Section):
    path: str = Field(
        description="Local Hugging Face causal-LM directory (config, safetensors, tokenizer)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Compute dtype of trainer (over fp32 master weights) and rollout; "
        "float16 adds dynamic loss scaling (trainer/loss_scale.py).",
    )
    frozen: list[str] = Field(
        [],
        description="Glob patterns of HF parameter names the policy never trains (e.g. "
        "'model.embed_tokens.*'); they are not optimised and not re-sent at weight sync.",
    )
    routing_replay: bool = Field(
        False,
        description="Mixture-of-experts policies: the rollout engines record the experts they "
        "route every position to, and the trainer's forwards use the same experts (rollout "
        "routing replay; the router's gate weights are still its own). docs/algorithms.md.",
    )

    lora: LoraConfig = Field(
        LoraConfig(), description="LoRA adapters instead of full fine-tuning (rank 0 = off)."
    )

    def frozen_names(self, names: list[str]) -> list[str]:
        """The `names` that `frozen` matches; a pattern matching none of them is an error."""
        matched = []
        for pattern in self.frozen:
            hits = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
            if not hits:
                raise ValueError(
                    f"model.frozen: {pattern!r} matches no parameter of {self.path}; names "
                    f"look like {', '.join(names[:3])}, ..."
                )
            matched += hits
        return matched


class BaseBuildConfig(Section):
    """The tiny pretrained checkpoint the CPU recipes build for themselves (`rl build-base`)."""

    build_if_missing: bool = Field(
        False, description="Build an SFT base at model.path when it does not exist."
    )
    vocab_size: int = Field(
        260,
        description="Target BPE vocabulary size (byte-level, so never below 260 tokens).",
    )
    architecture: Literal["qwen2", "qwen3_moe", "qwen2_moe"] = Field(
        "qwen2",
        description="The decoder built: qwen2 (dense), qwen3_moe (a mixture of experts in every "
        "layer) or qwen2_moe (experts plus a shared expert, gated, in every layer).",
    )
    hidden_size: int = Field(128, description="Hidden size.")
    num_layers: int = Field(2, description="Decoder layers.")
    num_heads: int = Field(
        4,
        description="Attention heads (head_dim = hidden_size / num_heads, at least 32 for vLLM CPU).",
    )
    num_kv_heads: int = Field(2, description="Key/value heads (grouped-query attention).")
    intermediate_size: int = Field(
        1024, description="MLP width (qwen2_moe: the shared expert's; qwen3_moe: unused)."
    )
    num_experts: int = Field(8, description="Mixture-of-experts architectures: experts a layer.")
    experts_per_token: int = Field(
        2, description="Mixture-of-experts architectures: experts each token is routed to (top-k)."
    )
    moe_intermediate_size: int = Field(
        256, description="Mixture-of-experts architectures: each expert's MLP width."
    )
    tie_word_embeddings: bool = Field(
        False, description="Share input embedding and lm_head weights."
    )
    max_position_embeddings: int = Field(
        2048,
        description="The longest sequence the model is built for (its config's "
        "max_position_embeddings, which vLLM bounds max_model_len by); at least "
        "rollout.max_model_len.",
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
    environment: str = Field(
        "",
        description="Agent recipes: the registered environment whose demonstrations the base "
        "is fine-tuned on and whose greedy episodes measure it (empty = agent.environment). An "
        "agent function (openai:...) has none: name one that speaks its protocol and tools.",
    )


class DataConfig(Section):
    task: str = Field(
        "addition",
        description="Task name from rl.data.tasks (addition, countdown, majority, math, repeat), or "
        "reasoning_gym:<dataset> for a reasoning-gym dataset (pip install -e .[reasoning-gym]).",
    )
    task_config: dict[str, Any] = Field(
        default_factory=dict,
        description="reasoning_gym:<dataset> tasks: the dataset's own config keys, as "
        "reasoning_gym.create_dataset takes them (chain_sum: {max_terms: 2, max_digits: 2}); "
        "sizes and seed come from data.num_train, data.num_test and data.seed.",
    )
    dir: str = Field(
        ".cache/data", description="Where generated train/test jsonl splits are written and read."
    )
    train_files: list[str] = Field(
        default_factory=list,
        description="jsonl/parquet files with prompt and answer columns; when set they replace "
        "the generated train split (GSM8K- or MATH-style data).",
    )
    test_files: list[str] = Field(
        default_factory=list, description="Held-out files, as train_files (required with them)."
    )
    num_train: int = Field(20000, description="Generated train prompts.")
    num_test: int = Field(500, description="Generated held-out prompts.")
    num_digits: int = Field(3, description="Addition: digits per operand.")
    zero_pad: bool = Field(
        True,
        description="Addition: zero-pad answers to num_digits+1 digits (123+456 -> 0579), so each "
        "answer digit sits at a fixed offset from its column whatever the sum's length.",
    )
    num_operands: int = Field(3, description="Countdown: numbers given (3 or 4).")
    seed: int = Field(
        1234, description="Seed of the task generator (splits are disjoint and deterministic)."
    )
    bad_rows: Literal["error", "skip"] = Field(
        "error",
        description="Rows of data files with a missing field or an empty prompt: stop with an "
        "error naming the file and row, or skip them and count them.",
    )
    max_prompt_tokens: int = Field(
        0,
        description="Drop (and count) prompts longer than this many tokens (0 = "
        "rollout.max_model_len - rollout.max_new_tokens, what the engine can take).",
    )


class RolloutConfig(Section):
    engine: str = Field(
        "vllm",
        description="Rollout engine from rollout.engines.registry.ENGINES: vllm, or torch (plain PyTorch "
        "over a KV cache, CPU, no tensor parallelism), faster for tiny models on CPU where "
        "vLLM's per-step cost dominates.",
    )
    num_workers: int = Field(1, description="RolloutWorker actors, one engine each.")
    tensor_parallel_size: int = Field(1, description="vLLM tensor parallelism inside each worker.")
    kv_cache_gb: float = Field(
        1.0, description="vLLM CPU KV-cache size per worker in GiB (never vLLM's all-RAM default)."
    )
    gpu_memory_utilization: float = Field(
        0.4, description="vLLM GPU memory fraction per worker (GPU only)."
    )
    max_model_len: int = Field(
        256,
        description="Longest prompt+response the engine accepts (vLLM's max_model_len); the "
        "prompt limit (data.max_prompt_tokens 0) and the trainer's widest packed row follow "
        "from it, and the KV budget must hold one such sequence (--dry-run checks).",
    )
    compile: bool | None = Field(
        None,
        description="vllm: compile the model (vLLM's enforce_eager=false). null = compiled on "
        "GPU, eager on CPU, where compiling costs start-up that only longer runs repay.",
    )
    max_new_tokens: int = Field(16, description="Response length cap.")
    temperature: float = Field(
        1.0, description="Sampling temperature (also used for trainer log-probs)."
    )
    top_p: float = Field(
        1.0,
        description="Nucleus sampling threshold; training needs 1 (the trainer's log-probs are "
        "of the full softmax, docs/algorithms.md).",
    )
    weight_transport: Literal["auto", "shared_memory", "distributed", "gathered"] = Field(
        "auto",
        description="Weight-sync transport: shared memory on one node; distributed, a process "
        "group between trainer and rollout ranks (gloo on CPU, NCCL on GPUs: each trainer rank "
        "sends each engine rank its own rows, no all-gather); or gathered (GPUs, colocate, one "
        "node), each bucket all-gathered into every trainer GPU and read there by CUDA IPC. "
        "auto picks gathered for colocated GPUs on one node, distributed across nodes or for "
        "GPUs of their own, else shared memory (distributed when /dev/shm is too small for two "
        "buckets).",
    )
    weight_bucket_mb: float = Field(
        64.0,
        gt=0,
        description="Weight-sync bucket size in MiB of full tensors in model.dtype, the dtype "
        "they travel in (a layer larger than this travels alone); each process holds at most "
        "two buckets extra during a sync.",
    )


class AgentConfig(Section):
    """Multi-turn episodes with tools (docs/agents.md); off while `environment` is empty."""

    environment: str = Field(
        "",
        description="Agent environment from rl.agents.environment.ENVIRONMENTS (tool_use, "
        "calculator), a user's path/to/file.py:ClassName, run only in sandboxed environment "
        "workers, or openai:path/to/file.py:function, an agent function calling the rollout "
        "worker's OpenAI-compatible endpoint from a sandbox; empty = single-turn prompt -> "
        "response. rollout.max_new_tokens then caps every token after the prompt: turns, tool "
        "results and template text.",
    )
    tools: list[str] = Field(
        default_factory=list,
        description="Tools besides the environment's: built-in names (python) or a user's "
        "path/to/file.py:function, run only in the sandboxed tool pool.",
    )
    tool_call_format: str = Field(
        "hermes", description="Tool-call syntax from rl.agents.tool_calls.TOOL_CALL_FORMATS."
    )
    max_turns: int = Field(4, description="Assistant turns per episode at most.")
    max_tool_output_tokens: int = Field(
        256, description="A tool result longer than this many tokens is cut and marked."
    )
    tool_workers: int = Field(4, description="Sandboxed tool worker processes per rollout worker.")
    tool_timeout_s: float = Field(30.0, description="Wall-clock limit of one tool call.")
    tool_cpu_s: float = Field(30.0, description="CPU-time limit of one tool call (whole seconds).")
    tool_memory_mb: int = Field(
        1024, description="Address-space limit of a tool call, MiB (0 = none)."
    )
    prefix_break: Literal["segment", "end"] = Field(
        "segment",
        description="An agent function's call whose history is not the episode's so far: "
        "'segment' starts a new sequence, trained as a sample of its own with the episode's "
        "advantage; 'end' refuses it (finish_reason length), training what came before.",
    )
    env_workers: int = Field(
        2, description="Sandboxed workers per process running a user's environment's methods."
    )
    env_timeout_s: float = Field(
        30.0,
        description="Wall-clock limit of one reset or step of a user's environment; of an agent "
        "function's own time in an episode (its calls' generation not counted).",
    )
    env_memory_mb: int = Field(
        2048, description="Address-space limit of a user's environment worker, MiB (0 = none)."
    )

    @property
    def enabled(self) -> bool:
        return bool(self.environment)


class TrainerConfig(Section):
    num_workers: int = Field(
        2, description="TrainWorker actors in one torch.distributed group (FSDP2 ranks)."
    )
    lr: float = Field(1e-5, description="AdamW learning rate (constant after warmup).")
    warmup_steps: int = Field(0, description="Linear LR warmup optimizer steps.")
    weight_decay: float = Field(0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, description="Global gradient-norm clip.")
    micro_batch_size: int = Field(
        32,
        description="Sequences per forward/backward on one rank (when micro_batch_tokens is 0).",
    )
    micro_batch_tokens: int = Field(
        0,
        description="Token positions per forward/backward on one rank (padding included, so "
        "rows x longest unless packing; with sequence_parallel N, a group's micro-batch holds N "
        "times as many); rows are dealt to the ranks balanced by length (Karmarkar-Karp). "
        "0 = micro_batch_size sequences, contiguous rows per rank.",
    )
    packing: bool = Field(
        False,
        description="Pack each micro-batch's samples end to end into rows as wide as its longest "
        "one (attention kept within each sample, positions restarted) instead of padding them.",
    )
    share_prompts: bool = Field(
        False,
        description="Compute the rows of a micro-batch that share a prompt (a GRPO group) as one "
        "row: the prompt once, then each response, attending to the prompt and to itself. Pays "
        "where prompts are long against responses; keep a group in one micro-batch (a "
        "micro_batch_size that is a multiple of group_size, no micro_batch_tokens).",
    )
    skip_zero_advantage_rows: bool = Field(
        False,
        description="Leave out of forward and backward the rows whose advantage is 0 on every "
        "token (GRPO groups whose samples all scored the same): their loss and gradient are "
        "exactly 0, and the loss keeps the whole batch's denominator, so the update is the "
        "same. Needs a loss without a KL or entropy term (algorithm.kl_coef = 0 or "
        "kl_in_reward, algorithm.entropy_coef = 0); actor/* metrics then cover the rows trained.",
    )
    sharding: Literal["zero3", "zero2", "hybrid", "none"] = Field(
        "zero3",
        description="FSDP2 strategy: zero3 gathers each layer's parameters for forward and "
        "again for backward; zero2 keeps them gathered in between; hybrid shards within groups "
        "of shard_group_size ranks and replicates across them; none replicates (DDP-like).",
    )
    shard_group_size: int = Field(
        0, description="sharding=hybrid: ranks per shard group (a node's ranks); divides the ranks."
    )
    sequence_parallel: int = Field(
        1,
        description="Ulysses sequence parallelism: groups of this many consecutive ranks run "
        "each packed row together, each rank 1/N of its positions (attention exchanges them "
        "for heads by all-to-all); divides num_workers and the attention heads; needs packing. "
        "1 = off.",
    )
    offload: bool = Field(
        False,
        description="Keep sharded parameters, gradients and optimizer state in CPU memory "
        "(FSDP2 CPU offload) on GPU runs; on CPU they are there already.",
    )
    num_mini_batches: int = Field(1, description="Optimizer steps per rollout batch per epoch.")
    num_epochs: int = Field(1, description="Passes over each rollout batch.")
    logprob_impl: Literal["fused", "naive"] = Field(
        "fused",
        description="LM-head log-probs: the fused kernel (never holds [tokens, vocab] logits) or "
        "the naive full-logits path, for comparison.",
    )
    logprob_chunk_size: int = Field(
        512,
        description="Log-prob kernel: tokens per chunk (the PyTorch path's forward and "
        "backward; the Triton path's backward).",
    )
    logprob_vocab_chunk_size: int = Field(
        8192,
        description="Log-prob kernel: vocabulary columns per chunk (as logprob_chunk_size).",
    )
    num_threads: int = Field(1, description="torch intra-op threads per trainer rank on CPU.")
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's forward in backward instead of keeping its "
        "activations (policy and critic): far less memory, about a third more compute.",
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer (policy, reference, critic), fusing its "
        "elementwise work; the first steps pay the compile. On CPU it needs a C++ compiler.",
    )


class AlgorithmConfig(Section):
    """Advantages, policy loss, KL control and off-policy correction (names from rl.algorithms)."""

    group_size: int = Field(8, description="Responses sampled per prompt (G).")
    advantage: str = Field(
        "grpo",
        description="Advantage estimator from rl.algorithms.advantages (gae needs a critic).",
    )
    normalize_std: bool = Field(
        True, description="grpo: divide group-centred rewards by the group std (off = Dr.GRPO)."
    )
    gamma: float = Field(1.0, description="gae, reinforce_pp: discount factor.")
    lam: float = Field(1.0, description="gae: lambda.")
    whiten_advantages: bool = Field(
        True, description="gae: normalise advantages over the batch's valid tokens."
    )
    policy_loss: str = Field("clipped", description="Policy loss from rl.algorithms.policy_losses.")
    clip_low: float = Field(
        0.2,
        description="PPO ratio clip below 1 (ratio >= 1 - clip_low); cispo: its IS weight's "
        "lower bound (>= 1: none, as MiniMax-M1).",
    )
    clip_high: float = Field(
        0.2,
        description="PPO ratio clip above 1 (clip-higher, DAPO, when > clip_low); cispo: its IS "
        "weight's upper bound 1 + clip_high.",
    )
    dual_clip: float = Field(
        0.0,
        description="Dual-clip bound c > 1 on the loss of negative-advantage tokens (0 = off).",
    )
    loss_agg: str = Field(
        "token-mean", description="Loss aggregation from rl.algorithms.aggregation."
    )
    kl_coef: float = Field(
        0.0, description="Weight of the KL to the frozen reference (0 = no reference at all)."
    )
    kl_estimator: str = Field("k3", description="KL estimator from rl.algorithms.kl.")
    kl_in_reward: bool = Field(
        False,
        description="Subtract kl_coef * KL from the per-token rewards (PPO-style) instead of "
        "adding it to the loss.",
    )
    kl_target: float = Field(
        0.0,
        description="kl_in_reward: adapt kl_coef towards this per-sequence KL (0 = fixed coef).",
    )
    kl_horizon: int = Field(10000, description="Adaptive KL controller horizon (samples).")
    entropy_coef: float = Field(0.0, description="Entropy bonus weight.")
    router_balance_coef: float = Field(
        0.0,
        description="MoE: weight of the load-balancing loss E sum_e f_e P_e, mean over MoE layers "
        "(rl.algorithms.router_losses; 0 = off).",
    )
    router_z_coef: float = Field(
        0.0,
        description="MoE: weight of the router z-loss, mean over tokens of logsumexp(router "
        "logits)^2, mean over MoE layers (0 = off).",
    )
    off_policy: str = Field(
        "none",
        description="Importance-sampling correction from rl.algorithms.off_policy "
        "(behaviour log-probs recorded at generation vs a recomputed proximal policy). With "
        "none, PPO's ratio and clip are taken against each token's behaviour log-prob, which "
        "corrects stale samples (scheduler.max_staleness > 0) by itself.",
    )
    is_cap: float = Field(2.0, description="Truncated IS: weights capped at this C.")
    is_low: float = Field(0.5, description="Masked IS: tokens/sequences with weight below dropped.")
    is_high: float = Field(
        2.0, description="Masked IS: tokens/sequences with weight above dropped."
    )
    geo_low: float = Field(
        0.999,
        description="geo-rs: sequences whose geometric-mean weight exp(mean_t log w_t) is below "
        "this are dropped.",
    )
    geo_high: float = Field(
        1.001, description="geo-rs: sequences whose geometric-mean weight is above this dropped."
    )
    recompute_old_logprobs: bool = Field(
        False,
        description="Recompute old log-probs with the trainer (the proximal policy of decoupled "
        "PPO) instead of using the behaviour log-probs; always on with an off_policy correction, "
        "and refused without one at scheduler.max_staleness >= 1 (stale samples uncorrected).",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO: drop groups whose rewards are all equal and generate more prompts until "
        "the batch is full.",
    )
    max_sampling_rounds: int = Field(
        3, description="Dynamic sampling: most generation rounds per step (then train on fewer)."
    )
    overlong_buffer: int = Field(
        0,
        description="DAPO overlong shaping: responses longer than max_new_tokens - buffer lose up "
        "to overlong_penalty, linearly (0 = off).",
    )
    overlong_penalty: float = Field(1.0, description="Overlong shaping: the largest penalty.")
    distill_coef: float = Field(
        0.0,
        description="On-policy distillation: weight of the teacher's per-token term "
        "(distill_loss) added to the task advantage on each sampled token; needs teacher.path "
        "(0 = off). Pure distillation: this with the task reward's weight 0.",
    )
    distill_loss: str = Field(
        "reverse_kl",
        description="Distillation term from rl.algorithms.distill: reverse_kl, "
        "-(behaviour log-prob - teacher log-prob) of each sampled token.",
    )


class CriticConfig(Section):
    """The PPO value model: its own FSDP2 group and optimizer (used when advantage=gae)."""

    path: str = Field(
        "", description="HF checkpoint to initialise from (empty = model.path, the policy)."
    )
    num_workers: int = Field(0, description="Critic ranks (0 = trainer.num_workers).")
    lr: float = Field(1e-5, description="Critic AdamW learning rate.")
    warmup_steps: int = Field(0, description="Critic linear LR warmup optimizer steps.")
    max_grad_norm: float = Field(1.0, description="Critic gradient-norm clip.")
    value_clip: float = Field(
        0.2, description="Clip new values to old values +- this (0 = no value clipping)."
    )


class TeacherConfig(Section):
    """On-policy distillation's teacher (algorithm.distill_coef > 0): a frozen model sharing the
    student's tokenizer that scores the student's sampled tokens (docs/algorithms.md)."""

    path: str = Field(
        "",
        description="Local HF causal-LM directory of the teacher; its tokenizer must be "
        "model.path's (same vocabulary, special tokens and chat template). Empty = no teacher.",
    )
    num_workers: int = Field(
        0,
        description="Teacher ranks: an FSDP2 group of its own, forward only (0 = "
        "trainer.num_workers).",
    )
    devices: int = Field(
        0,
        description="split placement: devices of the teacher's own, after the trainer's (0 = "
        "on the trainer's devices, as the reference and the critic).",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.path)


class JudgeConfig(Section):
    """A generative judge (a `judge` reward term): a local model served by a rollout engine, or
    an OpenAI-compatible endpoint (`url`), reads a prompt template filled with the prompt,
    response(s) and reference answer, and its verdict is parsed into a score (README,
    "Judges")."""

    model: str = Field(
        "",
        description="Local judge: an HF causal-LM directory served by a rollout engine; with "
        "url: the model name sent to the endpoint.",
    )
    url: str = Field(
        "",
        description="Base URL of an OpenAI-compatible API (requests go to URL/chat/completions); "
        "empty = a local judge.",
    )
    api_key_env: str = Field(
        "",
        description="url: the environment variable holding the API key (sent as a bearer "
        "token, never logged or saved); empty = no key.",
    )
    template: str = Field(
        "",
        description="The judge's prompt, inline, with {prompt}, {answer} and the mode's response "
        "fields ({response}; pairwise {response_a}, {response_b}; listwise {responses}, "
        "{num_responses}); {{ and }} are literal braces.",
    )
    template_file: str = Field(
        "", description="A file holding the template instead (exactly one of the two)."
    )
    mode: Literal["pointwise", "pairwise", "listwise"] = Field(
        "pointwise",
        description="pointwise: one judgement per response; pairwise: one per pair of a group's "
        "responses, a response scoring its mean share of its comparisons; listwise: one per "
        "group, scoring every response at once.",
    )
    parser: str = Field(
        "score",
        description="How a verdict becomes scores, from rl.rewards.judge_parsers.VERDICT_PARSERS: "
        "score or choice (pointwise and pairwise), scores or ranking (listwise).",
    )
    score_range: tuple[float, float] = Field(
        (0.0, 10.0),
        description="score/scores parsers: the valid [low, high]; a number x in it scores "
        "(x - low) / (high - low).",
    )
    choices: dict[str, float] = Field(
        {}, description="choice parser: each label the judge may answer, and its score."
    )
    verdict_marker: str = Field(
        "",
        description="The verdict is the judge's text after the last occurrence of this string "
        "(a missing marker is a parse failure); empty = the whole text.",
    )
    max_new_tokens: int = Field(16, ge=1, description="Longest verdict the judge may write.")
    temperature: float = Field(
        0.0, ge=0.0, description="The judge's sampling temperature (0 = greedy)."
    )
    max_concurrency: int = Field(
        16,
        ge=1,
        description="Judgements in flight at once: HTTP requests to url, or sequences a local "
        "judge's engine generates together.",
    )
    cache_size: int = Field(
        4096,
        ge=0,
        description="Verdicts kept, keyed by the judge's whole input (the prompt, response(s) "
        "and answer), and reused for the same input (0 = no cache).",
    )
    engine: str = Field(
        "vllm",
        description="Local judge: the rollout engine serving it, from "
        "rollout.engines.registry.ENGINES.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Local judge: the dtype its engine computes in."
    )
    max_model_len: int = Field(
        1024,
        ge=2,
        description="Local judge: longest input + verdict in tokens (a longer input is a "
        "failed judgement).",
    )
    kv_cache_gb: float = Field(
        0.25, gt=0, description="Local judge on CPU: the vLLM engine's KV-cache size in GiB."
    )
    gpu_memory_utilization: float = Field(
        0.2,
        gt=0,
        le=1,
        description="Local judge on a GPU: the fraction of its GPU's memory the vLLM engine takes.",
    )
    timeout_s: float = Field(
        60.0, gt=0, description="url: seconds one request may take before it is retried."
    )
    max_retries: int = Field(
        3,
        ge=0,
        description="url: retries of a request that timed out, failed to connect or got a 429 "
        "or 5xx, waiting backoff_s, then twice as long each time (or the Retry-After asked).",
    )
    backoff_s: float = Field(1.0, gt=0, description="url: the wait before the first retry.")
    requests_per_s: float = Field(
        0.0, ge=0, description="url: the most requests started per second (0 = no limit)."
    )


class RewardTermConfig(Section):
    """One reward: a verifier, a user's function, a reward model or a judge, with a weight."""

    name: str = Field(
        "task",
        description="'task' (the data task's verifier), a registered verifier from "
        "rl.rewards.VERIFIERS, 'path/to/file.py:function', 'model:PATH' (HF "
        "sequence-classification checkpoint), or 'judge' (a generative judge, set in `judge`).",
    )
    weight: float = Field(1.0, description="Weight of this term in the summed reward.")
    judge: JudgeConfig | None = Field(
        None, description="The judge of a term named 'judge' (README, 'Judges')."
    )


class RewardConfig(Section):
    terms: list[RewardTermConfig] = Field(
        default_factory=lambda: [RewardTermConfig()],
        description="Rewards summed with their weights.",
    )
    timeout_s: float = Field(
        10.0, description="A reward function slower than this scores 0 for that sample."
    )
    on_error: Literal["zero", "fail"] = Field(
        "zero",
        description="A reward function that raises or times out, or a judge's verdict that "
        "fails or does not parse: score 0 and count it, or fail.",
    )
    num_processes: int = Field(2, description="Worker processes evaluating reward functions.")
    memory_mb: int = Field(
        4096,
        description="Address-space limit of each reward worker process, MiB (0 = none): a "
        "function that allocates past it fails instead of starving the run.",
    )
    inherit_env: list[str] = Field(
        [],
        description="Environment variables reward workers inherit from the driver besides "
        "PATH, the locale and PYTHONPATH (HOME and TMPDIR are private; credentials are not "
        "passed unless listed here).",
    )
    model_batch_size: int = Field(32, description="Reward model: sequences per forward.")
    cap_truncated: bool = Field(
        True,
        description="A response or episode cut by rollout.max_new_tokens or agent.max_turns scores "
        "at most the lowest finished one of its group (docs/agents.md, 'How episodes are scored').",
    )


class SandboxConfig(Section):
    """The sandbox every process running users' code gets: reward functions, environments
    and tools (rl.isolation, docs/agents.md "What a sandbox isolates")."""

    require: bool = Field(
        False,
        description="Refuse to run users' code unless its workers are fully isolated "
        "(own network, pid and mount namespaces, an unprivileged user, a private filesystem); "
        "false = run with what the kernel allows and report what is missing.",
    )
    tmp_mb: int = Field(
        256,
        ge=1,
        description="Size of a sandboxed worker's private, memory-backed HOME, /tmp, /var/tmp "
        "and /dev/shm together, MiB; also the largest file it may write.",
    )


class Config(Section):
    model: ModelConfig
    base: BaseBuildConfig = BaseBuildConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    agent: AgentConfig = AgentConfig()
    trainer: TrainerConfig = TrainerConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    critic: CriticConfig = CriticConfig()
    teacher: TeacherConfig = TeacherConfig()
    reward: RewardConfig = RewardConfig()
    sandbox: SandboxConfig = SandboxConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    faults: FaultsConfig = FaultsConfig()
    run: RunConfig = RunConfig()

    def critic_world_size(self) -> int:
        """critic.num_workers, where 0 means as many ranks as the policy trainer."""
        return self.critic.num_workers or self.trainer.num_workers

    def teacher_world_size(self) -> int:
        """teacher.num_workers, where 0 means as many ranks as the policy trainer."""
        return self.teacher.num_workers or self.trainer.num_workers
