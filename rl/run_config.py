"""The run-level sections of the config tree (rl.config): where roles run and how far
generation runs ahead, how a run is saved and resumed, which faults it absorbs, and its
length and reporting. Also the base every section derives from.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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
    partial_rollout: Literal["finish", "abort"] = Field(
        "finish",
        description="At a weight sync, generations in flight finish under the old weights, or "
        "are aborted and resumed under the new ones with their prefix kept.",
    )

    @property
    def time_sliced(self) -> bool:
        """Roles take turns on the same devices: colocated and on-policy (k = 0)."""
        return self.placement == "colocate" and self.max_staleness == 0


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
    num_eval_prompts: int = Field(200, description="Held-out prompts per evaluation.")
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


class CheckpointConfig(Section):
    """Checkpoints that continue a run exactly (`rl train RECIPE --resume auto|PATH`)."""

    every: int = Field(
        0, description="Write a checkpoint every N steps (0 = only at the end and on preemption)."
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
