"""Recipes load into the typed config and overrides patch it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rl.config import Config
from rl.config.recipe import ConfigError, check_inputs, dry_run_report, load_config
from rl.data.prompts import padding_id
from tests.helpers.models import (
    build_checkpoint,
    build_moe_checkpoint,
    build_tiny_checkpoint,
    remove_pad_token,
)
from tests.helpers.repo import REPO, shipped_recipes
from trainer.hf_model import train_tokenizer


def test_every_shipped_recipe_validates() -> None:
    recipes = shipped_recipes()
    assert recipes
    for recipe in recipes:
        load_config(recipe)


def test_overrides_apply_in_order_and_parse_yaml_scalars() -> None:
    cfg = load_config(
        REPO / "recipes/grpo_addition_cpu.yaml",
        ["trainer.lr=3e-6", "trainer.betas=[0.9,0.95]", "run.export_hf=false", "trainer.lr=4e-6"],
    )
    assert cfg.trainer.lr == 4e-6
    assert cfg.trainer.betas == (0.9, 0.95)
    assert cfg.run.export_hf is False


def test_override_into_a_value_is_rejected() -> None:
    with pytest.raises(ConfigError, match="trainer.lr is a value, not a section"):
        load_config(REPO / "recipes/grpo_addition_cpu.yaml", ["trainer.lr.x=1"])


def test_override_without_equals_is_rejected() -> None:
    with pytest.raises(ConfigError, match="is not key=value"):
        load_config(REPO / "recipes/grpo_addition_cpu.yaml", ["trainer.lr"])


def test_non_mapping_recipe_is_rejected(tmp_path: Path) -> None:
    recipe = tmp_path / "list.yaml"
    recipe.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="a recipe is a mapping"):
        load_config(recipe)


def test_extends_merges_the_child_over_its_parent(tmp_path: Path) -> None:
    (tmp_path / "parent.yaml").write_text(
        "model:\n  path: m\ntrainer:\n  lr: 0.1\n  num_epochs: 2\nrun:\n  name: parent\n"
    )
    (tmp_path / "child.yaml").write_text("extends: parent.yaml\ntrainer:\n  lr: 0.2\n")
    cfg = load_config(tmp_path / "child.yaml", ["run.name=override"])
    assert (cfg.trainer.lr, cfg.trainer.num_epochs) == (0.2, 2)
    assert cfg.model.path == "m" and cfg.run.name == "override"


def test_extends_errors_name_the_files(tmp_path: Path) -> None:
    (tmp_path / "child.yaml").write_text("extends: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"missing.yaml \(extended by .*child.yaml\)"):
        load_config(tmp_path / "child.yaml")
    (tmp_path / "loop.yaml").write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(tmp_path / "loop.yaml")
    (tmp_path / "typo.yaml").write_text("extends: child2.yaml\ntrainer:\n  lrr: 1\n")
    (tmp_path / "child2.yaml").write_text("model:\n  path: m\n")
    with pytest.raises(ConfigError, match=r"typo.yaml: unknown key 'trainer.lrr'"):
        load_config(tmp_path / "typo.yaml")


def test_skipping_zero_advantage_rows_is_refused_when_those_rows_have_a_kl_gradient() -> None:
    recipe = REPO / "recipes/grpo_addition_cpu.yaml"
    skip = "trainer.skip_zero_advantage_rows=true"
    assert load_config(recipe, [skip]).trainer.skip_zero_advantage_rows
    with pytest.raises(ConfigError, match=r"grpo_addition_cpu.yaml: .*algorithm.kl_coef=0.1"):
        load_config(recipe, [skip, "algorithm.kl_coef=0.1"])
    with pytest.raises(ConfigError, match=r"algorithm.entropy_coef=0.01"):
        load_config(recipe, [skip, "algorithm.entropy_coef=0.01"])


def test_nucleus_sampling_is_refused_because_the_trainer_scores_the_full_softmax() -> None:
    recipe = REPO / "recipes/grpo_addition_cpu.yaml"
    assert load_config(recipe, ["rollout.top_p=1.0"]).rollout.top_p == 1.0
    with pytest.raises(ConfigError, match=r"grpo_addition_cpu.yaml: rollout.top_p=0.9: .*top_p=1"):
        load_config(recipe, ["rollout.top_p=0.9"])


def test_a_base_built_shorter_than_the_engines_context_is_refused() -> None:
    recipe = REPO / "recipes/grpo_majority_sp_cpu.yaml"
    cfg = load_config(recipe)
    assert cfg.rollout.max_model_len <= cfg.base.max_position_embeddings
    with pytest.raises(ConfigError, match=r"max_model_len=3072 exceeds .*embeddings=2048"):
        load_config(recipe, ["base.max_position_embeddings=2048"])
    # A base built from the recipe's shape carries the bound vLLM reads.
    from trainer.hf_model import new_model, train_tokenizer

    tokenizer = train_tokenizer(["ab" * 50, "ba" * 50], cfg.base.vocab_size)
    model = new_model(cfg.base, tokenizer, seed=0)
    assert model.config.max_position_embeddings == cfg.base.max_position_embeddings == 4096


def _model_dir_config(model_dir: Path) -> Config:
    recipe = REPO / "recipes/grpo_addition_cpu.yaml"
    return load_config(recipe, [f"model.path={model_dir}", "base.build_if_missing=false"])


def test_a_model_directory_without_a_tokenizer_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    model_dir = build_tiny_checkpoint(tmp_path / "model", tie_word_embeddings=False)
    check_inputs(_model_dir_config(model_dir), "recipe.yaml")  # whole: accepted
    for name in os.listdir(model_dir):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (model_dir / name).unlink()
    with pytest.raises(
        ConfigError, match=r"recipe.yaml: model.path=.* has no tokenizer: .*tokenizer.json"
    ):
        check_inputs(_model_dir_config(model_dir), "recipe.yaml")


def test_a_model_directory_without_safetensors_or_with_a_bad_header_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    model_dir = build_tiny_checkpoint(tmp_path / "model", tie_word_embeddings=False)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # its header cut short
    with pytest.raises(ConfigError, match=r"model.path: .*model.safetensors: safetensors header"):
        check_inputs(_model_dir_config(model_dir), "recipe.yaml")
    weights.rename(model_dir / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"has no \*.safetensors files: the trainer reads"):
        check_inputs(_model_dir_config(model_dir), "recipe.yaml")


def test_a_tokenizer_without_a_pad_token_is_accepted_and_pads_with_eos(tmp_path: Path) -> None:
    # Llama's tokenizer class has no default pad token (Qwen2's falls back to <|endoftext|>).
    model_dir = build_checkpoint(tmp_path / "model", "llama", tie_word_embeddings=False)
    remove_pad_token(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None
    check_inputs(_model_dir_config(model_dir), "recipe.yaml")
    assert padding_id(tokenizer) == tokenizer.eos_token_id


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true"], "put the KL in the loss"),
        (["algorithm.kl_coef=0.1", "algorithm.kl_estimator=k1"], "gradient of zero mean"),
        (["algorithm.policy_loss=gspo"], "set algorithm.loss_agg=seq-mean-token-mean"),
    ],
)
def test_algorithm_combinations_that_change_the_objective_are_refused(
    overrides: list[str], error: str
) -> None:
    with pytest.raises(ConfigError, match=error):
        load_config(REPO / "recipes/grpo_addition_cpu.yaml", overrides)


def test_the_same_algorithms_compose_where_their_definitions_hold() -> None:
    recipe = REPO / "recipes/grpo_addition_cpu.yaml"
    load_config(recipe, ["algorithm.kl_coef=0.1", "algorithm.kl_estimator=k2"])  # k2 in the loss
    load_config(recipe, ["algorithm.policy_loss=gspo", "algorithm.loss_agg=seq-mean-token-mean"])
    load_config(
        recipe,
        [
            "algorithm.advantage=reinforce_pp_baseline",
            "algorithm.kl_coef=0.1",
            "algorithm.kl_in_reward=true",
            "algorithm.kl_estimator=k1",
        ],
    )


def test_a_recomputed_proximal_policy_without_a_correction_is_refused_on_stale_samples() -> None:
    """At max_staleness 1 (the demo's), recomputed proximal log-probs with off_policy none
    would replace the behaviour ones: PPO's ratio starts at 1 and no term weighs a stale
    token by the policy that sampled it. Refused naming the keys and each way out."""
    recipe = REPO / "recipes/grpo_addition_cpu.yaml"
    assert load_config(recipe).scheduler.max_staleness == 1
    with pytest.raises(ConfigError) as refused:
        load_config(recipe, ["algorithm.recompute_old_logprobs=true"])
    message = str(refused.value)
    for named in (
        "grpo_addition_cpu.yaml: algorithm.recompute_old_logprobs=true",
        "algorithm.off_policy=none",
        "scheduler.max_staleness=1",
        "Set algorithm.off_policy=decoupled",
        "algorithm.recompute_old_logprobs=false",
    ):
        assert named in message
    # The ways out it names load: a correction against the recomputed proximal policy,
    # on-policy samples, or PPO's ratio against the behaviour log-probs (the recipe as is).
    for way_out in ("algorithm.off_policy=decoupled", "scheduler.max_staleness=0"):
        load_config(recipe, ["algorithm.recompute_old_logprobs=true", way_out])


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("rollout.temperature=0", "rollout.temperature=0.0: training samples at a temperature > 0"),
        ("rollout.kv_cache_gb=0", "rollout.kv_cache_gb must be > 0, got 0.0"),
        ("rollout.gpu_memory_utilization=1.5", r"rollout.gpu_memory_utilization .* \(0, 1\]"),
        ("rollout.tensor_parallel_size=0", "rollout.tensor_parallel_size must be >= 1, got 0"),
        ("trainer.num_workers=0", "trainer.num_workers must be >= 1, got 0"),
        ("trainer.num_mini_batches=0", "trainer.num_mini_batches must be >= 1, got 0"),
        ("trainer.num_epochs=0", "trainer.num_epochs must be >= 1, got 0"),
        ("run.num_eval_prompts=-1", "run.num_eval_prompts must be >= 0, got -1"),
        ("run.eval_every=-1", "run.eval_every must be >= 0, got -1"),
        ("checkpoint.every=-1", "checkpoint.every must be >= 0, got -1"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last must be >= 1, got 0"),
        ("faults.max_nonfinite_steps=0", "faults.max_nonfinite_steps must be >= 1, got 0"),
    ],
)
def test_values_the_actors_would_refuse_are_refused_by_the_recipe_checks(
    override: str, error: str
) -> None:
    with pytest.raises(ConfigError, match=rf"grpo_addition_cpu.yaml: {error}"):
        load_config(REPO / "recipes/grpo_addition_cpu.yaml", [override])


def test_no_eval_prompts_is_a_run_without_evaluation() -> None:
    cfg = load_config(REPO / "recipes/grpo_addition_cpu.yaml", ["run.num_eval_prompts=0"])
    assert cfg.run.num_eval_prompts == 0


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["model.lora.rank=600"], r"model.lora.rank must be 0 \(off\) to 512"),
        (["model.lora.rank=8", "model.lora.alpha=0"], "model.lora.alpha must be > 0, got 0.0"),
        (["model.lora.rank=8", "model.lora.dropout=1"], r"model.lora.dropout must be in \[0, 1\)"),
        (
            ["model.lora.rank=8", "model.lora.target_modules=[]"],
            "model.lora.target_modules is empty",
        ),
        (
            ["model.lora.rank=8", "model.frozen=[model.embed_tokens.*]"],
            "model.frozen does not apply with LoRA",
        ),
        (
            ["model.lora.rank=8", "critic.path=/models/other-critic"],
            r"critic.path=/models/other-critic is another model than model.path=.*; with LoRA",
        ),
    ],
)
def test_lora_settings_that_cannot_train_are_refused(overrides: list[str], error: str) -> None:
    with pytest.raises(ConfigError, match=rf"grpo_addition_cpu.yaml: {error}"):
        load_config(REPO / "recipes/grpo_addition_cpu.yaml", overrides)


def test_a_lora_run_takes_a_critic_from_the_policys_base() -> None:
    recipe = REPO / "recipes/ppo_addition_cpu.yaml"
    cfg = load_config(recipe, ["model.lora.rank=8"])
    same = load_config(recipe, ["model.lora.rank=8", f"critic.path={cfg.model.path}"])
    assert same.critic.path == cfg.model.path


def test_a_lora_target_the_model_lacks_is_named_with_the_models_linear_modules(
    tmp_path: Path,
) -> None:
    model_dir = build_tiny_checkpoint(tmp_path / "model", tie_word_embeddings=False)
    cfg = _model_dir_config(model_dir)
    cfg.model.lora.rank = 8
    check_inputs(cfg, "recipe.yaml")  # the default targets: Qwen2's seven linears
    cfg.model.lora.target_modules = ["q_proj", "qkv_proj"]
    linear = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
    with pytest.raises(
        ConfigError,
        match=rf"'qkv_proj' is not a linear module of .*; its layers' linear modules are {linear}",
    ):
        check_inputs(cfg, "recipe.yaml")


def test_the_run_summary_says_where_abort_points_are() -> None:
    recipe = REPO / "recipes" / "grpo_addition_cpu.yaml"
    overlap = ["scheduler.max_staleness=1", "scheduler.partial_rollout=abort"]
    auto = dry_run_report(load_config(recipe, overlap), recipe)
    fixed = dry_run_report(load_config(recipe, [*overlap, "scheduler.abort_every=4"]), recipe)
    assert "partial_rollout=abort at the 95th percentile of the last synced step's" in auto
    assert "partial_rollout=abort every 4 tokens" in fixed
    carry = ["scheduler.partial_rollout=carry", "scheduler.max_stale_share=0.25"]
    report = dry_run_report(load_config(recipe, carry), recipe)
    # The demo's 64 prompts a step: twice that in flight by default.
    assert (
        "partial_rollout=carry at the median of the last synced step's response lengths, each "
        "step the first of 128 groups in flight to finish; tokens at most 4 versions old, at "
        "most 0.25 of them over 1"
    ) in report


def test_carry_over_is_refused_with_uncorrected_stale_samples_or_an_age_bound_below_k() -> None:
    """partial_rollout carry trains tokens older than the step before it even at
    max_staleness 0 (a carried sample's first tokens), so the recompute-without-correction
    refusal holds there too; and an age bound below k would leave nothing to train."""
    recipe = REPO / "recipes/grpo_addition_cpu.yaml"
    carry = ["scheduler.partial_rollout=carry", "scheduler.max_staleness=0"]
    with pytest.raises(ConfigError, match="max_staleness=0 with partial_rollout=carry"):
        load_config(recipe, [*carry, "algorithm.recompute_old_logprobs=true"])
    load_config(
        recipe, [*carry, "algorithm.recompute_old_logprobs=true", "algorithm.off_policy=decoupled"]
    )
    with pytest.raises(ConfigError, match="scheduler.max_token_age=1 is below"):
        load_config(
            recipe,
            [
                "scheduler.partial_rollout=carry",
                "scheduler.max_staleness=2",
                "scheduler.max_token_age=1",
            ],
        )
    assert load_config(recipe, carry).scheduler.partial_rollout == "carry"


@pytest.mark.parametrize(
    "overrides, refusal",
    [
        (["trainer.num_mini_batches=2"], "trainer.num_mini_batches=2 and trainer.num_epochs=1"),
        (["trainer.num_epochs=2"], "trainer.num_mini_batches=1 and trainer.num_epochs=2"),
        (["algorithm.advantage=reinforce_pp"], "algorithm.advantage=reinforce_pp whitens"),
        (["scheduler.max_staleness=0"], "colocated at max_staleness=0 the roles take turns"),
        (["model.lora.rank=8", "model.lora.dropout=0.1"], "model.lora.dropout=0.1 draws"),
    ],
)
def test_streaming_is_refused_where_a_step_cannot_be_trained_group_by_group(
    overrides: list[str], refusal: str
) -> None:
    """One optimizer step a step, advantages a group's own, devices the trainer may use while
    the engines generate, and nothing random drawn in the groups' arrival order."""
    recipe = REPO / "recipes/grpo_addition_cpu.yaml"  # max_staleness 1, colocated, GRPO
    load_config(recipe, ["scheduler.streaming=true"])
    with pytest.raises(ConfigError, match=refusal):
        load_config(recipe, ["scheduler.streaming=true", *overrides])
    load_config(recipe, overrides)  # each is fine without streaming


def test_the_run_summary_says_how_big_a_streamed_chunk_is() -> None:
    recipe = REPO / "recipes/grpo_addition_cpu.yaml"
    # The demo: 2 trainer ranks x micro-batches of 128 sequences, groups of 8: 32 groups.
    report = dry_run_report(load_config(recipe, ["scheduler.streaming=true"]), recipe)
    assert "the trainer streams each step in chunks of 32 groups as they finish" in report
    chosen = ["scheduler.streaming=true", "scheduler.stream_groups=3"]
    assert "in chunks of 3 groups" in dry_run_report(load_config(recipe, chosen), recipe)
    assert "streams" not in dry_run_report(load_config(recipe, []), recipe)


def test_streaming_takes_gae_only_without_whitening_over_the_step() -> None:
    recipe = REPO / "recipes/ppo_addition_cpu.yaml"
    streamed = ["scheduler.streaming=true", "scheduler.max_staleness=1"]
    with pytest.raises(ConfigError, match="algorithm.advantage=gae with whiten_advantages"):
        load_config(recipe, [*streamed, "algorithm.whiten_advantages=true"])
    load_config(recipe, [*streamed, "algorithm.whiten_advantages=false"])


def test_a_recipe_selects_cispo_icepop_and_geo_rs_and_their_bounds() -> None:
    recipe = REPO / "recipes/grpo_addition_cpu.yaml"
    cfg = load_config(
        recipe,
        [
            "algorithm.policy_loss=cispo",
            "algorithm.clip_low=1.0",
            "algorithm.off_policy=geo-rs",
            "algorithm.geo_low=0.99",
            "algorithm.geo_high=1.01",
        ],
    )
    assert (cfg.algorithm.policy_loss, cfg.algorithm.off_policy) == ("cispo", "geo-rs")
    assert (cfg.algorithm.geo_low, cfg.algorithm.geo_high) == (0.99, 1.01)
    assert load_config(recipe, ["algorithm.off_policy=icepop"]).algorithm.off_policy == "icepop"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["algorithm.geo_low=1.001"], r"algorithm.geo_low=1.001 and algorithm.geo_high=1.001"),
        (["algorithm.geo_high=0.9"], r"algorithm.geo_low=0.999 and algorithm.geo_high=0.9"),
        (["algorithm.is_low=-0.5"], r"algorithm.is_low=-0.5 and algorithm.is_high=2.0"),
        (["algorithm.is_high=0.8"], r"algorithm.is_low=0.5 and algorithm.is_high=0.8"),
    ],
)
def test_a_masking_band_that_excludes_ratio_one_is_refused_naming_its_keys(
    overrides: list[str], named: str
) -> None:
    # Tokens whose engine and trainer agree exactly (ratio 1) must stay in the loss.
    with pytest.raises(ConfigError, match=rf"grpo_addition_cpu.yaml: {named} must bracket 1"):
        load_config(REPO / "recipes/grpo_addition_cpu.yaml", overrides)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["algorithm.distill_coef=1"], r"distils from a teacher: set teacher.path"),
        (["teacher.path=t"], r"teacher.path='t' would be loaded for nothing"),
        (["teacher.path=t", "algorithm.distill_coef=-1"], r"distill_coef must be >= 0"),
        (
            ["teacher.path=t", "algorithm.distill_coef=1", "algorithm.distill_loss=forward_kl"],
            r"algorithm.distill_loss='forward_kl' is not one of reverse_kl",
        ),
        (
            ["teacher.path=t", "algorithm.distill_coef=1", "teacher.devices=1"],
            r"teacher.devices=1 .* needs scheduler.placement=split",
        ),
    ],
)
def test_distillation_settings_without_their_counterpart_are_refused(
    overrides: list[str], error: str
) -> None:
    with pytest.raises(ConfigError, match=error):
        load_config(REPO / "recipes/grpo_addition_cpu.yaml", overrides)


def _distill_config(student: Path, teacher: Path) -> Config:
    recipe = REPO / "recipes/distill_addition_cpu.yaml"
    overrides = [f"model.path={student}", f"teacher.path={teacher}"]
    return load_config(recipe, [*overrides, "base.build_if_missing=false"])


def test_a_teacher_of_another_size_sharing_the_students_tokenizer_is_accepted(
    tmp_path: Path,
) -> None:
    student = build_tiny_checkpoint(tmp_path / "student", tie_word_embeddings=False)
    teacher = build_checkpoint(
        tmp_path / "teacher", "qwen2", tie_word_embeddings=True, hidden_size=128
    )
    check_inputs(_distill_config(student, teacher), "recipe.yaml")


def test_a_teacher_whose_tokenizer_reads_ids_otherwise_is_refused_naming_teacher_path(
    tmp_path: Path,
) -> None:
    student = build_tiny_checkpoint(tmp_path / "student", tie_word_embeddings=False)
    teacher = build_tiny_checkpoint(tmp_path / "teacher", tie_word_embeddings=False)
    # Merges of words (the student's arithmetic, its digits split, has none): the teacher reads
    # ids past the bytes and special tokens as tokens the student's vocabulary lacks.
    train_tokenizer(["the cat sat on the mat"] * 50, 280).save_pretrained(teacher)
    with pytest.raises(
        ConfigError,
        match=r"recipe.yaml: teacher.path=.*teacher' does not share the tokenizer of "
        r"model.path=.*student' \(vocabularies of 260 and \d+ tokens differ, first at id 260",
    ):
        check_inputs(_distill_config(student, teacher), "recipe.yaml")


def test_a_teacher_with_another_chat_template_is_refused(tmp_path: Path) -> None:
    student = build_tiny_checkpoint(tmp_path / "student", tie_word_embeddings=False)
    teacher = build_tiny_checkpoint(tmp_path / "teacher", tie_word_embeddings=False)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(teacher)
    with pytest.raises(ConfigError, match=r"teacher.path=.* \(chat templates differ\)"):
        check_inputs(_distill_config(student, teacher), "recipe.yaml")


def test_a_missing_teacher_is_refused_before_anything_starts(tmp_path: Path) -> None:
    student = build_tiny_checkpoint(tmp_path / "student", tie_word_embeddings=False)
    with pytest.raises(ConfigError, match=r"teacher.path=.*absent' is not a Hugging Face"):
        check_inputs(_distill_config(student, tmp_path / "absent"), "recipe.yaml")


@pytest.mark.parametrize(
    "setting",
    [
        "model.routing_replay=true",
        "algorithm.router_balance_coef=0.01",
        "algorithm.router_z_coef=1e-3",
    ],
)
def test_a_mixture_of_experts_setting_on_a_dense_model_is_refused(
    tmp_path: Path, setting: str
) -> None:
    dense = _model_dir_config(build_tiny_checkpoint(tmp_path / "dense", tie_word_embeddings=False))
    key = setting.split("=")[0]
    overrides = [f"model.path={dense.model.path}", setting]
    cfg = load_config(REPO / "recipes/grpo_addition_cpu.yaml", overrides)
    with pytest.raises(ConfigError, match=rf"{key} is for a mixture of experts' routers, but the "):
        check_inputs(cfg, "recipe.yaml")
    # The base a recipe builds is checked before it exists.
    unbuilt = [f"model.path={tmp_path / 'unbuilt'}", "base.build_if_missing=true", setting]
    cfg = load_config(REPO / "recipes/grpo_addition_cpu.yaml", unbuilt)
    with pytest.raises(ConfigError, match=r"base.architecture=qwen2"):
        check_inputs(cfg, "recipe.yaml")
    moe = build_moe_checkpoint(tmp_path / "moe", "qwen3_moe")
    check_inputs(
        load_config(REPO / "recipes/grpo_addition_cpu.yaml", [f"model.path={moe}", setting]),
        "recipe.yaml",
    )


def test_lora_on_a_mixture_of_experts_served_by_vllm_is_refused(tmp_path: Path) -> None:
    moe = build_moe_checkpoint(tmp_path / "moe", "qwen3_moe")
    recipe = REPO / "recipes/grpo_addition_cpu.yaml"
    lora = [f"model.path={moe}", "model.lora.rank=8"]
    with pytest.raises(
        ConfigError, match=r"model.lora on a mixture of experts .* rollout.engine=torch only"
    ):
        check_inputs(load_config(recipe, [*lora, "rollout.engine=vllm"]), "recipe.yaml")
    check_inputs(load_config(recipe, [*lora, "rollout.engine=torch"]), "recipe.yaml")
