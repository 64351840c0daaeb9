"""Cross-field rules of a recipe that the config's field types cannot express, checked by
`rl.config.recipe.load_config` after validation: each raises `ConfigError` naming the file, the keys
and how to fix them."""

from __future__ import annotations

import os
from pathlib import Path

from rl.config import Config


class ConfigError(ValueError):
    """A user error in a recipe or an override."""


def check_consistency(cfg: Config, path: Path | str) -> None:
    """Cross-field rules that the field types cannot express."""
    # First: the rules below divide by some of these.
    for key, value, minimum in (
        ("trainer.num_workers", cfg.trainer.num_workers, 1),
        ("trainer.micro_batch_size", cfg.trainer.micro_batch_size, 1),
        ("trainer.num_mini_batches", cfg.trainer.num_mini_batches, 1),
        ("trainer.num_epochs", cfg.trainer.num_epochs, 1),
        ("trainer.sequence_parallel", cfg.trainer.sequence_parallel, 1),
        ("rollout.num_workers", cfg.rollout.num_workers, 1),
        ("rollout.tensor_parallel_size", cfg.rollout.tensor_parallel_size, 1),
        ("run.num_steps", cfg.run.num_steps, 1),
        ("run.eval_every", cfg.run.eval_every, 0),
        ("run.num_eval_prompts", cfg.run.num_eval_prompts, 0),
        ("checkpoint.every", cfg.checkpoint.every, 0),
        ("checkpoint.keep_last", cfg.checkpoint.keep_last, 1),
        ("faults.max_nonfinite_steps", cfg.faults.max_nonfinite_steps, 1),
    ):
        if value < minimum:
            raise ConfigError(f"{path}: {key} must be >= {minimum}, got {value}")
    sp = cfg.trainer.sequence_parallel
    if cfg.trainer.num_workers % sp:
        raise ConfigError(
            f"{path}: trainer.sequence_parallel={sp} must divide trainer.num_workers="
            f"{cfg.trainer.num_workers}: the ranks form groups of that many"
        )
    num_sequences = cfg.run.prompts_per_step * cfg.algorithm.group_size
    # Rows are dealt to the data-parallel ranks: the sequence-parallel groups.
    per_step = cfg.trainer.num_workers // sp * cfg.trainer.num_mini_batches
    if num_sequences % per_step:
        raise ConfigError(
            f"{path}: run.prompts_per_step * algorithm.group_size = {num_sequences} sequences must split "
            f"evenly over trainer.num_workers / trainer.sequence_parallel * "
            f"trainer.num_mini_batches = {per_step}; change one of them"
        )
    _check_registered_names(cfg, path)
    _check_algorithm(cfg, path)
    _check_trainer(cfg, path)
    _check_rollout(cfg, path)
    _check_scheduler(cfg, path)
    _check_agent(cfg, path)
    _check_lora(cfg, path)
    _check_distillation(cfg, path)


def _check_distillation(cfg: Config, path: Path | str) -> None:
    """algorithm.distill_coef and the teacher go together (the teacher's files are checked
    with the other inputs: rl.config.recipe.check_teacher)."""
    coef, teacher = cfg.algorithm.distill_coef, cfg.teacher
    if coef < 0:
        raise ConfigError(f"{path}: algorithm.distill_coef must be >= 0 (0 = off), got {coef}")
    if coef > 0 and not teacher.enabled:
        raise ConfigError(
            f"{path}: algorithm.distill_coef={coef} distils from a teacher: set teacher.path "
            "to its HF directory (sharing model.path's tokenizer), or algorithm.distill_coef=0"
        )
    if teacher.enabled and coef == 0:
        raise ConfigError(
            f"{path}: teacher.path={teacher.path!r} would be loaded for nothing with "
            "algorithm.distill_coef=0: set a coefficient > 0 (pure distillation: with the "
            "task reward's weight 0), or drop teacher.path"
        )
    for key, value in (("num_workers", teacher.num_workers), ("devices", teacher.devices)):
        if value < 0:
            raise ConfigError(f"{path}: teacher.{key} must be >= 0, got {value}")
    if teacher.devices and cfg.scheduler.placement != "split":
        raise ConfigError(
            f"{path}: teacher.devices={teacher.devices} gives the teacher devices of its own "
            "beside the trainer's, which needs scheduler.placement=split; colocated, every role "
            "shares every device (drop teacher.devices)"
        )


# The largest adapter rank vLLM serves (its LoRAConfig.max_lora_rank choices end there).
MAX_LORA_RANK = 512


def _check_lora(cfg: Config, path: Path | str) -> None:
    lora = cfg.model.lora
    if lora.rank < 0 or lora.rank > MAX_LORA_RANK:
        raise ConfigError(
            f"{path}: model.lora.rank must be 0 (off) to {MAX_LORA_RANK} (the largest rank "
            f"vLLM serves), got {lora.rank}"
        )
    if not lora.enabled:
        return
    if not lora.alpha > 0:
        raise ConfigError(f"{path}: model.lora.alpha must be > 0, got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"{path}: model.lora.dropout must be in [0, 1), got {lora.dropout}")
    if not lora.target_modules:
        raise ConfigError(f"{path}: model.lora.target_modules is empty: name the linear modules")
    if cfg.model.frozen:
        raise ConfigError(
            f"{path}: model.frozen does not apply with LoRA (model.lora.rank > 0): the base is "
            "frozen whole and only the adapters train"
        )
    critic = Path(cfg.critic.path) if cfg.critic.path else None
    if critic is not None and critic.resolve() != Path(cfg.model.path).resolve():
        raise ConfigError(
            f"{path}: critic.path={cfg.critic.path} is another model than model.path="
            f"{cfg.model.path}; with LoRA (model.lora.rank > 0) the critic starts from the "
            "base the adapters train on: leave critic.path empty, or train without LoRA"
        )


def _check_agent(cfg: Config, path: Path | str) -> None:
    agent = cfg.agent
    from rl.agents.ecosystem import check_pairing

    try:
        check_pairing(agent.environment, cfg.data.task, bool(cfg.data.train_files))
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    if not agent.enabled:
        return
    from rl.agents.environment import check_environment
    from rl.agents.tool_calls import TOOL_CALL_FORMATS
    from rl.agents.tools import resolve_tool

    try:  # users' files are read, not imported: they run only in their sandboxes
        check_environment(agent.environment)
        for tool in agent.tools:
            resolve_tool(tool)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    if agent.tool_call_format not in TOOL_CALL_FORMATS:
        raise ConfigError(
            f"{path}: agent.tool_call_format={agent.tool_call_format!r} is not one of "
            f"{', '.join(TOOL_CALL_FORMATS.names())}"
        )
    for key, value, minimum in (
        ("agent.max_turns", agent.max_turns, 1),
        ("agent.max_tool_output_tokens", agent.max_tool_output_tokens, 1),
        ("agent.tool_workers", agent.tool_workers, 1),
        ("agent.tool_timeout_s", agent.tool_timeout_s, 1e-3),
        ("agent.tool_cpu_s", agent.tool_cpu_s, 1),
        ("agent.tool_memory_mb", agent.tool_memory_mb, 0),
        ("agent.env_workers", agent.env_workers, 1),
        ("agent.env_timeout_s", agent.env_timeout_s, 1e-3),
        ("agent.env_memory_mb", agent.env_memory_mb, 0),
    ):
        if value < minimum:
            raise ConfigError(f"{path}: {key} must be >= {minimum}, got {value}")
    if cfg.trainer.share_prompts:
        raise ConfigError(
            f"{path}: trainer.share_prompts does not apply to agent episodes: it shares a row's "
            "tokens before its first trained one, and an episode's later turns differ per sample "
            "after the prompt anyway; set trainer.share_prompts=false"
        )


def _check_trainer(cfg: Config, path: Path | str) -> None:
    from rl.algorithms.advantages import needs_critic  # torch: not at import
    from rl.algorithms.objective import zero_advantage_rows_are_inert

    trainer = cfg.trainer
    if trainer.micro_batch_tokens < 0:
        raise ConfigError(
            f"{path}: trainer.micro_batch_tokens must be >= 0 (0 = trainer.micro_batch_size "
            f"sequences), got {trainer.micro_batch_tokens}"
        )
    if trainer.packing and trainer.share_prompts:
        raise ConfigError(
            f"{path}: trainer.packing and trainer.share_prompts are two layouts of a "
            "micro-batch (samples end to end, or one row per prompt); set one of them"
        )
    if trainer.skip_zero_advantage_rows and not zero_advantage_rows_are_inert(cfg.algorithm):
        raise ConfigError(
            f"{path}: trainer.skip_zero_advantage_rows leaves out rows whose loss is exactly 0, "
            f"but with algorithm.kl_coef={cfg.algorithm.kl_coef} (kl_in_reward="
            f"{cfg.algorithm.kl_in_reward}) and algorithm.entropy_coef="
            f"{cfg.algorithm.entropy_coef} every row has a gradient; set "
            "algorithm.kl_coef=0 (or kl_in_reward=true) and algorithm.entropy_coef=0, or drop it"
        )
    _check_sequence_parallel(cfg, path)
    if trainer.sharding != "hybrid":
        if trainer.shard_group_size:
            raise ConfigError(
                f"{path}: trainer.shard_group_size sizes hybrid sharding; with "
                f"trainer.sharding={trainer.sharding} drop it (or set trainer.sharding=hybrid)"
            )
        return
    ranks = {"trainer.num_workers": trainer.num_workers}
    if needs_critic(cfg):
        ranks["critic ranks"] = cfg.critic_world_size()
    if cfg.teacher.enabled:
        ranks["teacher ranks"] = cfg.teacher_world_size()
    size = trainer.shard_group_size
    for key, num_ranks in ranks.items():
        if size < 1 or num_ranks % size:
            raise ConfigError(
                f"{path}: trainer.sharding=hybrid needs trainer.shard_group_size, the ranks per "
                f"shard group, >= 1 and dividing {key}={num_ranks}; got {size}"
            )


def _check_sequence_parallel(cfg: Config, path: Path | str) -> None:
    """What trainer.sequence_parallel > 1 runs with (the model's heads are checked where it
    loads: trainer.sequence_parallel.prepare_model)."""
    from rl.algorithms.advantages import needs_critic  # torch: not at import

    trainer, sp = cfg.trainer, cfg.trainer.sequence_parallel
    if sp == 1:
        return
    unsupported = {
        "trainer.packing=false (it splits packed rows)": not trainer.packing,
        "trainer.share_prompts": trainer.share_prompts,
        "trainer.compile": trainer.compile,
    }
    for what, present in unsupported.items():
        if present:
            raise ConfigError(
                f"{path}: trainer.sequence_parallel={sp} does not run with {what}; "
                "set trainer.sequence_parallel=1 or change that"
            )
    # The critic and the teacher run sequence-parallel as the policy does, in groups of their
    # own ranks.
    ranks = {}
    if needs_critic(cfg):
        ranks["critic.num_workers"] = cfg.critic_world_size()
    if cfg.teacher.enabled:
        ranks["teacher.num_workers"] = cfg.teacher_world_size()
    for key, num_ranks in ranks.items():
        if num_ranks % sp:
            raise ConfigError(
                f"{path}: trainer.sequence_parallel={sp} must divide {key} (its ranks: "
                f"{num_ranks}): they form groups of that many, as the policy's do"
            )


def _check_rollout(cfg: Config, path: Path | str) -> None:
    from rollout.engines.registry import ENGINES

    rollout = cfg.rollout
    if rollout.temperature <= 0:
        # The trainer scores log_softmax(logits / T); greedy decoding has no such policy.
        raise ConfigError(
            f"{path}: rollout.temperature={rollout.temperature}: training samples at a "
            "temperature > 0, which the trainer's log-probs divide the logits by"
        )
    if rollout.kv_cache_gb <= 0:
        raise ConfigError(f"{path}: rollout.kv_cache_gb must be > 0, got {rollout.kv_cache_gb}")
    if cfg.base.build_if_missing and rollout.max_model_len > cfg.base.max_position_embeddings:
        # vLLM refuses a max_model_len beyond the model's own bound.
        raise ConfigError(
            f"{path}: rollout.max_model_len={rollout.max_model_len} exceeds the base this "
            f"recipe builds (base.max_position_embeddings={cfg.base.max_position_embeddings}): "
            "raise base.max_position_embeddings"
        )
    if not 0 < rollout.gpu_memory_utilization <= 1:
        raise ConfigError(
            f"{path}: rollout.gpu_memory_utilization is a fraction of each GPU's memory, in "
            f"(0, 1]; got {rollout.gpu_memory_utilization}"
        )
    if rollout.top_p != 1.0:
        # The engines record each token's log-prob renormalised over the nucleus (vLLM's
        # processed log-probs), the trainer the full softmax's: every ratio and importance
        # weight would be off by the nucleus mass.
        raise ConfigError(
            f"{path}: rollout.top_p={rollout.top_p}: training samples from the full softmax "
            "(top_p=1), since the trainer's log-probs and the engines' behaviour log-probs "
            "only agree there; set rollout.top_p=1 (docs/algorithms.md)"
        )
    traits = ENGINES.traits(rollout.engine)
    if not traits.tensor_parallel and rollout.tensor_parallel_size != 1:
        raise ConfigError(
            f"{path}: rollout.engine={rollout.engine} runs each engine in one process: set "
            f"rollout.tensor_parallel_size=1 (got {rollout.tensor_parallel_size}), or use "
            f"rollout.engine={'/'.join(ENGINES.names(lambda t: t.tensor_parallel))} for "
            "tensor parallelism"
        )
    if not traits.compiles and rollout.compile is not None:
        raise ConfigError(
            f"{path}: rollout.compile={rollout.compile} chooses how the engine runs its model; "
            f"rollout.engine={rollout.engine} has no compiled mode: drop rollout.compile"
        )


def _check_scheduler(cfg: Config, path: Path | str) -> None:
    sched, tp = cfg.scheduler, cfg.rollout.tensor_parallel_size
    if sched.devices_per_node % tp:
        raise ConfigError(
            f"{path}: scheduler.devices_per_node={sched.devices_per_node} must be a multiple of "
            f"rollout.tensor_parallel_size={tp}: an engine's tensor-parallel ranks share one node"
        )
    if sched.placement == "split" and sched.num_devices:
        raise ConfigError(
            f"{path}: scheduler.num_devices sizes the colocated pool; with "
            "scheduler.placement=split set scheduler.rollout_devices and "
            "scheduler.trainer_devices instead"
        )
    if sched.streaming:
        _check_streaming(cfg, path)
    if sched.placement == "colocate":
        for key in ("rollout_devices", "trainer_devices"):
            if getattr(sched, key):
                raise ConfigError(
                    f"{path}: scheduler.{key} sizes the split placement; with "
                    "scheduler.placement=colocate every role shares one pool (set "
                    "scheduler.placement=split, or drop the key)"
                )
        return
    for key, value in (
        ("rollout_devices", sched.rollout_devices),
        ("trainer_devices", sched.trainer_devices),
    ):
        if value < 0:
            raise ConfigError(f"{path}: scheduler.{key} must be >= 0 (0 = sized from workers)")
    if sched.rollout_devices and sched.rollout_devices % tp:
        raise ConfigError(
            f"{path}: scheduler.rollout_devices={sched.rollout_devices} must be a multiple of "
            f"rollout.tensor_parallel_size={tp} (each rollout worker spans that many devices)"
        )


def _check_streaming(cfg: Config, path: Path | str) -> None:
    """scheduler.streaming trains a step chunk by chunk, before its last group is in: one
    optimizer step per step, advantages per group, and a trainer free to run while the
    engines generate."""
    from rl.algorithms.advantages import couples_groups  # torch: not at import

    trainer = cfg.trainer
    if trainer.num_mini_batches != 1 or trainer.num_epochs != 1:
        raise ConfigError(
            f"{path}: scheduler.streaming accumulates one optimizer step over the step's groups "
            f"as they finish; trainer.num_mini_batches={trainer.num_mini_batches} and "
            f"trainer.num_epochs={trainer.num_epochs} must both be 1 (or drop streaming)"
        )
    if couples_groups(cfg.algorithm):
        raise ConfigError(
            f"{path}: scheduler.streaming computes each group's advantages as it finishes; "
            f"algorithm.advantage={cfg.algorithm.advantage}"
            f"{' with whiten_advantages' if cfg.algorithm.advantage == 'gae' else ''} whitens "
            "over the whole step (use a per-group estimator such as grpo or rloo, set "
            "algorithm.whiten_advantages=false for gae, or drop streaming)"
        )
    if cfg.model.lora.enabled and cfg.model.lora.dropout > 0:
        raise ConfigError(
            f"{path}: scheduler.streaming trains a step's groups in the order they finish, "
            f"which timing decides, and model.lora.dropout={cfg.model.lora.dropout} draws each "
            "group's masks in that order: the run would not be reproducible (set "
            "model.lora.dropout=0, or drop streaming)"
        )
    if cfg.scheduler.time_sliced:
        raise ConfigError(
            f"{path}: scheduler.streaming trains while the step's tail generates; colocated at "
            "max_staleness=0 the roles take turns on the devices (set scheduler.placement=split "
            "or scheduler.max_staleness >= 1, or drop streaming)"
        )


def _check_algorithm(cfg: Config, path: Path | str) -> None:
    algo = cfg.algorithm
    if algo.group_size < 1:
        raise ConfigError(f"{path}: algorithm.group_size must be >= 1, got {algo.group_size}")
    from rl.algorithms.advantages import ADVANTAGES

    if ADVANTAGES.traits(algo.advantage).group_baseline and algo.group_size < 2:
        raise ConfigError(
            f"{path}: algorithm.advantage={algo.advantage} needs algorithm.group_size >= 2 "
            "(its baseline is the other responses to the same prompt)"
        )
    if (
        algo.kl_coef > 0
        and algo.kl_in_reward
        and not ADVANTAGES.traits(algo.advantage).kl_in_reward
    ):
        raise ConfigError(
            f"{path}: algorithm.advantage={algo.advantage} normalises scores within each group, "
            "so a KL penalty in the reward would be amplified to the size of the score signal "
            "and an all-correct group would no longer get advantage 0: put the KL in the loss "
            "(algorithm.kl_in_reward=false, as DeepSeekMath's GRPO) or use advantage "
            "reinforce_pp_baseline"
        )
    from rl.algorithms.kl import KL_ESTIMATORS
    from rl.algorithms.policy_losses import POLICY_LOSSES

    if algo.kl_coef > 0 and not algo.kl_in_reward:
        if not KL_ESTIMATORS.traits(algo.kl_estimator).loss_gradient:
            valid = KL_ESTIMATORS.names(lambda t: bool(t.loss_gradient))
            raise ConfigError(
                f"{path}: algorithm.kl_estimator={algo.kl_estimator} as a loss term has a "
                "gradient of zero mean (it only adds noise); use one of "
                f"{', '.join(valid)} (docs/algorithms.md), or algorithm.kl_in_reward=true"
            )
    required = POLICY_LOSSES.traits(algo.policy_loss).aggregation
    if required and algo.loss_agg != required:
        raise ConfigError(
            f"{path}: algorithm.policy_loss={algo.policy_loss} is defined with the "
            f"{required} aggregation; set algorithm.loss_agg={required} (got {algo.loss_agg})"
        )
    if algo.dual_clip and algo.dual_clip <= 1:
        raise ConfigError(
            f"{path}: algorithm.dual_clip must be 0 (off) or > 1, got {algo.dual_clip}"
        )
    for low_key, high_key in (("is_low", "is_high"), ("geo_low", "geo_high")):
        low, high = getattr(algo, low_key), getattr(algo, high_key)
        if not 0 <= low <= 1 <= high:
            # A band that excludes 1 would drop tokens whose engine and trainer agree exactly.
            raise ConfigError(
                f"{path}: algorithm.{low_key}={low} and algorithm.{high_key}={high} must "
                f"bracket 1: 0 <= {low_key} <= 1 <= {high_key}"
            )
    if algo.kl_target > 0 and not (algo.kl_in_reward and algo.kl_coef > 0):
        raise ConfigError(
            f"{path}: algorithm.kl_target adapts the KL reward penalty; it needs "
            "algorithm.kl_in_reward=true and an initial algorithm.kl_coef > 0"
        )
    from rl.algorithms.off_policy import OFF_POLICY_CORRECTIONS

    k = cfg.scheduler.max_staleness
    carry = cfg.scheduler.partial_rollout == "carry"
    if (
        (k >= 1 or carry)
        and algo.recompute_old_logprobs
        and not OFF_POLICY_CORRECTIONS.traits(algo.off_policy).needs_proximal
    ):
        # The recomputed proximal log-probs replace the behaviour ones as PPO's old policy, so
        # no term would weigh a stale token by the policy that sampled it (docs/algorithms.md).
        raise ConfigError(
            f"{path}: algorithm.recompute_old_logprobs=true with "
            f"algorithm.off_policy={algo.off_policy} at scheduler.max_staleness={k}"
            f"{' with partial_rollout=carry' if carry else ''} trains "
            "stale samples uncorrected: the recomputed proximal log-probs replace the "
            "behaviour ones, so PPO's ratio starts at 1 and nothing weighs a token by the "
            "policy that sampled it. Set algorithm.off_policy=decoupled (decoupled PPO, as "
            "AReaL's recompute_logprob with use_decoupled_loss: the clip around the proximal "
            "policy, each token weighed by exp(proximal - behaviour)) or another correction, "
            "or algorithm.recompute_old_logprobs=false (PPO's ratio and clip against each "
            "token's behaviour log-prob), or scheduler.max_staleness=0"
            + (" and another partial_rollout" if carry else "")
        )
    if carry and cfg.scheduler.max_token_age < k:
        raise ConfigError(
            f"{path}: scheduler.max_token_age={cfg.scheduler.max_token_age} is below "
            f"scheduler.max_staleness={k}: under partial_rollout=carry max_token_age bounds "
            "every trained token and max_staleness says which of them count as stale "
            "(max_stale_share); set max_token_age >= max_staleness"
        )
    if algo.max_sampling_rounds < 1:
        raise ConfigError(f"{path}: algorithm.max_sampling_rounds must be >= 1")
    if not 0 <= algo.overlong_buffer < cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"{path}: algorithm.overlong_buffer={algo.overlong_buffer} must be in "
            f"[0, rollout.max_new_tokens={cfg.rollout.max_new_tokens})"
        )
    from rl.data.tasks import get_task

    if get_task(cfg.data.task).needs_files and not cfg.data.train_files:
        raise ConfigError(
            f"{path}: data.task={cfg.data.task} is read from files: set data.train_files and "
            "data.test_files (jsonl or parquet with prompt and answer columns)"
        )
    if cfg.critic.num_workers < 0:
        raise ConfigError(f"{path}: critic.num_workers must be >= 0 (0 = trainer.num_workers)")
    from rl.rewards import check_reward_terms

    # A judge may be the base this recipe builds before it starts (base.build_if_missing).
    will_exist = {os.path.abspath(cfg.model.path)} if cfg.base.build_if_missing else set()
    try:
        check_reward_terms(cfg.reward, will_exist)
    except ValueError as exc:
        raise ConfigError(f"{path}: reward.terms: {exc}") from None
    _check_judges(cfg, path)


def _check_judges(cfg: Config, path: Path | str) -> None:
    """A judge that compares a group's responses needs groups of several."""
    for index, term in enumerate(cfg.reward.terms):
        judge = term.judge
        if judge is not None and judge.mode != "pointwise" and cfg.algorithm.group_size < 2:
            raise ConfigError(
                f"{path}: reward.terms[{index}].judge.mode={judge.mode!r} compares the responses "
                f"of a group, but algorithm.group_size={cfg.algorithm.group_size}: use "
                "mode=pointwise, or groups of 2 or more"
            )


def _check_registered_names(cfg: Config, path: Path | str) -> None:
    """Names looked up in registries fail here, not after the actors have started."""
    from rl.algorithms.advantages import ADVANTAGES
    from rl.algorithms.aggregation import LOSS_AGGREGATIONS
    from rl.algorithms.distill import DISTILL_LOSSES
    from rl.algorithms.kl import KL_ESTIMATORS
    from rl.algorithms.off_policy import OFF_POLICY_CORRECTIONS
    from rl.algorithms.policy_losses import POLICY_LOSSES
    from rl.data.tasks import TASKS, get_task
    from rollout.engines.registry import ENGINES

    for key, value, registry in (
        # A family's task, "family:member", is checked as a whole below.
        ("data.task", cfg.data.task.partition(":")[0], TASKS),
        ("rollout.engine", cfg.rollout.engine, ENGINES),
        ("algorithm.advantage", cfg.algorithm.advantage, ADVANTAGES),
        ("algorithm.policy_loss", cfg.algorithm.policy_loss, POLICY_LOSSES),
        ("algorithm.loss_agg", cfg.algorithm.loss_agg, LOSS_AGGREGATIONS),
        ("algorithm.kl_estimator", cfg.algorithm.kl_estimator, KL_ESTIMATORS),
        ("algorithm.off_policy", cfg.algorithm.off_policy, OFF_POLICY_CORRECTIONS),
        ("algorithm.distill_loss", cfg.algorithm.distill_loss, DISTILL_LOSSES),
    ):
        if value not in registry:
            raise ConfigError(
                f"{path}: {key}={value!r} is not one of {', '.join(registry.names())}"
            )
    try:
        get_task(cfg.data.task).check(cfg.data)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
