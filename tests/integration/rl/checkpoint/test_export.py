"""`rl export` on a real checkpoint of a 2-rank gloo trainer: the exported HF model holds the
trainer's own export bit for bit, generates like it in transformers and in vLLM; damaged or
tampered checkpoints are refused with exit code 2 before anything is written."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl.algorithms.objective import Objective
from rl.checkpoint.export import MODEL_FILES_DIR, copy_model_files, export_checkpoint
from rl.checkpoint.store import CheckpointError, CheckpointWriter, checkpoint_root, verify
from rl.config import Config
from rl.types import Batch
from tests.helpers.models import build_checkpoint
from tests.helpers.ports import free_ports
from tests.helpers.repo import REPO
from tests.helpers.tampering import redeclare_as_pickle, relocate_shards
from trainer.policy import PolicyTrainer

pytestmark = pytest.mark.integration

STEP = 3
LORA_RANK = 8
MAX_NEW_TOKENS = 12
EMBEDDING = "model.model.embed_tokens.weight"  # its DCP key in the policy shards


def _batch(vocab: int) -> Batch:
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, vocab, (4, 12), generator=gen)
    loss_mask = torch.zeros(4, 11)
    loss_mask[:, 4:] = 1.0
    logprobs = -torch.rand(4, 11, generator=gen) * loss_mask
    advantages = torch.randn(4, 1, generator=gen) * loss_mask
    return Batch(
        input_ids, torch.ones_like(input_ids), loss_mask, logprobs, logprobs.clone(), advantages
    )


def _train_save_export(rank: int, jobs: list[tuple[Config, Path]], ports: list[int]) -> None:
    """Per model: one step, then the DCP checkpoint and the trainer's own HF export of the
    same weights (both models in one spawn: each process imports torch once)."""
    for i, (cfg, step_dir) in enumerate(jobs):
        trainer = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", ports[i])
        vocab = trainer.policy.model.config.vocab_size
        trainer.train_step(_batch(vocab))
        trainer.save_checkpoint(str(step_dir / "policy"))
        trainer.export_hf(str(step_dir.parent.parent / "live_hf"))
        trainer.close()


@pytest.fixture(scope="module")
def runs(
    tiny_model_dir: Path, tiny_tied_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """ "untied"/"tied"/"lora"/"frozen" (model.frozen) -> a run directory holding checkpoints/step_000003 (committed, with
    driver.json and the base's files, as `rl train` writes them) and live_hf (the trainer's
    export at the checkpoint's weights)."""
    jobs, commits, out = [], [], {}
    for kind, model_dir, model in (
        ("untied", tiny_model_dir, {}),
        ("tied", tiny_tied_model_dir, {}),
        ("lora", tiny_model_dir, {"lora": {"rank": LORA_RANK}}),
        ("frozen", tiny_model_dir, {"frozen": ["model.embed_tokens.*"]}),
    ):
        run_dir = tmp_path_factory.mktemp(f"run-{kind}")
        cfg = Config.model_validate(
            {
                "model": {"path": str(model_dir), **model},
                "trainer": {"num_workers": 2, "lr": 1e-2},
            }
        )
        writer = CheckpointWriter(checkpoint_root(run_dir), keep_last=2)
        step_dir = writer.begin(STEP)
        copy_model_files(model_dir, step_dir / MODEL_FILES_DIR)
        jobs.append((cfg, step_dir))
        commits.append((writer, step_dir, cfg))
        out[kind] = run_dir
    mp.spawn(_train_save_export, args=(jobs, free_ports(len(jobs))), nprocs=2)
    for writer, step_dir, cfg in commits:
        driver_state = {"step": STEP, "config": cfg.model_dump(mode="json")}
        (step_dir / "driver.json").write_text(json.dumps(driver_state))
        writer.commit(step_dir, STEP)
    return out


def _checkpoint(run: Path) -> Path:
    return checkpoint_root(run) / f"step_{STEP:06d}"


def _export(checkpoint: Path, out_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    """The real CLI, in a fresh process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "rl.cli", "export", str(checkpoint), "--to", str(out_dir), *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _prompts(tokenizer) -> list[list[int]]:
    """A chat-templated prompt (as rollouts see them) and two raw ones."""
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+34="}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return [list(chat), tokenizer.encode("7+8="), tokenizer.encode("905+13=918\n4")]


def _hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """New token ids of transformers' greedy decoding, up to and including EOS."""
    return _greedy(AutoModelForCausalLM.from_pretrained(model_dir), prompts)


def _greedy(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    """New token ids of `model.generate`'s greedy decoding, up to and including EOS."""
    outputs = []
    for prompt in prompts:  # one at a time: no padding to strip
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


# Greedy decoding of each model directory in turn (with a LoRA adapter directory over it when
# one is given), with rollout.engines.vllm_engine's CPU settings (fp32, eager, a small KV cache).
_VLLM_SCRIPT = """
import gc, json, sys
import vllm
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
jobs, max_tokens = json.loads(sys.argv[1]), int(sys.argv[2])
results = []
for model_dir, prompts, adapter, rank in jobs:
    lora = {"enable_lora": True, "max_loras": 1, "max_lora_rank": rank} if adapter else {}
    llm = vllm.LLM(model=model_dir, dtype="float32", max_model_len=128, enforce_eager=True,
                   kv_cache_memory_bytes=64 << 20, seed=0, disable_log_stats=True, **lora)
    request = LoRARequest("exported", 1, adapter) if adapter else None
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens),
                        use_tqdm=False, lora_request=request)
    results.append([list(o.outputs[0].token_ids) for o in outs])
    del llm
    gc.collect()
print("RESULT " + json.dumps(results))
"""


def _vllm_greedy(
    jobs: list[tuple[Path, list[list[int]]]], adapters: list[Path | None] | None = None
) -> list[list[list[int]]]:
    """vLLM's greedy new token ids per (model dir, prompts), each model served with the
    LoRA adapter directory of the same index in `adapters` where there is one, in one fresh
    process (vLLM reads its settings from the environment at import)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override kv_cache_memory_bytes
    adapters = adapters or [None] * len(jobs)
    payload = json.dumps(
        [
            [str(d), prompts, adapter and str(adapter), LORA_RANK]
            for (d, prompts), adapter in zip(jobs, adapters, strict=True)
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", _VLLM_SCRIPT, payload, str(MAX_NEW_TOKENS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _assert_same_weights(exported: Path, live: Path, base: Path | None) -> None:
    """Every exported tensor is the live export's, bit for bit, and (when `base` is given)
    some differ from the base's. The live export also stores a tied lm_head; the export
    leaves it out (the HF convention for tied checkpoints), so it must equal the embedding
    the model reads it from."""
    got = load_file(exported / "model.safetensors")
    want = load_file(live / "model.safetensors")
    for name, tensor in got.items():
        assert tensor.dtype == want[name].dtype == torch.float32, name
        assert torch.equal(tensor, want[name]), name
    for name in want.keys() - got.keys():
        config = json.loads((exported / "config.json").read_text())
        assert name == "lm_head.weight" and config["tie_word_embeddings"], name
        assert torch.equal(want[name], got["model.embed_tokens.weight"])
    if base is not None:
        before = load_file(base / "model.safetensors")
        assert any(not torch.equal(before[name], tensor) for name, tensor in got.items())
    for name in ("config.json", "generation_config.json"):
        assert json.loads((exported / name).read_text()) == json.loads((live / name).read_text())


def test_export_matches_the_trainers_own_export_in_transformers_and_vllm(
    runs: dict[str, Path], tiny_model_dir: Path, tiny_tied_model_dir: Path, tmp_path: Path
) -> None:
    bases = {"untied": tiny_model_dir, "tied": tiny_tied_model_dir}
    greedy, vllm_jobs = [], []
    for kind in bases:
        run = runs[kind]
        out_dir = tmp_path / kind
        result = _export(_checkpoint(run), out_dir)
        assert result.returncode == 0, result.stderr
        assert f"HF model written to {out_dir}" in result.stdout
        _assert_same_weights(out_dir, run / "live_hf", bases[kind])

        tokenizer = AutoTokenizer.from_pretrained(out_dir)
        assert tokenizer.chat_template == AutoTokenizer.from_pretrained(bases[kind]).chat_template
        assert tokenizer.chat_template
        prompts = _prompts(tokenizer)
        hf = _hf_greedy(out_dir, prompts)
        assert hf == _hf_greedy(run / "live_hf", prompts), kind
        greedy.append(hf)
        vllm_jobs.append((out_dir, prompts))
    # Not a degenerate comparison: the untied model's continuations vary.
    assert len({tuple(ids) for ids in greedy[0]}) == len(greedy[0])
    assert _vllm_greedy(vllm_jobs) == greedy


def test_a_lora_checkpoint_exports_its_adapters_or_merged_and_both_load_in_transformers_and_vllm(
    runs: dict[str, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel

    run = runs["lora"]
    live = run / "live_hf"  # the trainer's own export: merged, and the adapters in adapter/
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    result = _export(_checkpoint(run), adapter_dir)
    assert result.returncode == 0, result.stderr
    assert f"LoRA adapters (PEFT format) written to {adapter_dir}" in result.stdout
    assert not (adapter_dir / "config.json").exists()  # no model: peft and vLLM add the base
    got = load_file(adapter_dir / "adapter_model.safetensors")
    want = load_file(live / "adapter" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], want[name]) for name in want)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == LORA_RANK
    assert Path(config["base_model_name_or_path"]) == tiny_model_dir.resolve()

    result = _export(_checkpoint(run), merged_dir, "--merge")
    assert result.returncode == 0, result.stderr
    assert f"HF model written to {merged_dir}" in result.stdout
    _assert_same_weights(merged_dir, live, tiny_model_dir)

    # transformers: the merged model, and peft's adapter over the base without merging.
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    prompts = _prompts(tokenizer)
    merged = _hf_greedy(merged_dir, prompts)
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter_dir
    ).eval()
    assert _greedy(adapted, prompts) == merged
    # Not a degenerate comparison: the adapters change what the base says.
    assert merged != _hf_greedy(tiny_model_dir, prompts)
    # vLLM: the merged model as any model, the adapters as a LoRARequest over the base.
    jobs = [(merged_dir, prompts), (tiny_model_dir, prompts)]
    assert _vllm_greedy(jobs, [None, adapter_dir]) == [merged, merged]

    # --merge is for LoRA runs only.
    result = _export(_checkpoint(runs["untied"]), tmp_path / "full", "--merge")
    assert result.returncode == 2
    assert "is a checkpoint of a full fine-tune: export it without --merge" in result.stderr


def test_a_run_with_frozen_parameters_exports_them_from_its_base(
    runs: dict[str, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    checkpoint = _checkpoint(runs["frozen"])
    held = json.loads((checkpoint / "policy" / "shapes.json").read_text())
    assert "model.embed_tokens.weight" not in held and "lm_head.weight" in held
    out_dir = export_checkpoint(checkpoint, tmp_path / "exported")
    _assert_same_weights(out_dir, runs["frozen"] / "live_hf", tiny_model_dir)
    embedding = "model.embed_tokens.weight"
    base = load_file(tiny_model_dir / "model.safetensors")[embedding]
    assert torch.equal(load_file(out_dir / "model.safetensors")[embedding], base)


def test_a_lora_checkpoint_whose_base_is_gone_exports_its_adapters_but_refuses_to_merge(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    gone = tmp_path / "no-such-base"

    def base_moved_away(step_dir: Path) -> None:
        driver_state = json.loads((step_dir / "driver.json").read_text())
        driver_state["config"]["model"]["path"] = str(gone)
        (step_dir / "driver.json").write_text(json.dumps(driver_state))

    checkpoint = _recommitted(runs["lora"], tmp_path, base_moved_away)
    with pytest.raises(CheckpointError, match=rf"the rest is the base, model.path={gone}"):
        export_checkpoint(checkpoint, tmp_path / "merged", merge=True)
    assert not (tmp_path / "merged").exists()
    adapter_dir = export_checkpoint(checkpoint, tmp_path / "adapter")
    want = load_file(runs["lora"] / "live_hf" / "adapter" / "adapter_model.safetensors")
    got = load_file(adapter_dir / "adapter_model.safetensors")
    assert all(torch.equal(got[name], want[name]) for name in want)


def _damaged_copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "checkpoints" / f"step_{STEP:06d}"
    shutil.copytree(_checkpoint(run), copy)
    return copy


def test_a_corrupted_shard_is_refused_by_name_and_nothing_is_written(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    checkpoint = _damaged_copy(runs["untied"], tmp_path)
    shard = sorted((checkpoint / "policy").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    out_dir = tmp_path / "exported"
    result = _export(checkpoint, out_dir)
    assert result.returncode == 2, result.stderr
    assert str(shard) in result.stderr
    assert not out_dir.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".exported")]


def test_a_checkpoint_without_manifest_is_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    checkpoint = _damaged_copy(runs["untied"], tmp_path)
    (checkpoint / "manifest.json").unlink()
    out_dir = tmp_path / "exported"
    result = _export(checkpoint, out_dir)
    assert result.returncode == 2, result.stderr
    assert "manifest.json is missing" in result.stderr
    assert not out_dir.exists()


def _recommitted(run: Path, tmp_path: Path, edit: Callable[[Path], None]) -> Path:
    """The run's checkpoint copied under `tmp_path`, changed by `edit(step_dir)` and
    committed again (a fresh manifest), as a checkpoint written that way would be."""
    writer = CheckpointWriter(tmp_path / "checkpoints", keep_last=1)
    step_dir = writer.begin(STEP)
    shutil.copytree(_checkpoint(run), step_dir, dirs_exist_ok=True)
    (step_dir / "manifest.json").unlink()
    edit(step_dir)
    return writer.commit(step_dir, STEP)


def test_a_checkpoint_exports_on_its_own_once_its_base_model_is_gone(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    def base_moved_away(step_dir: Path) -> None:
        driver_state = json.loads((step_dir / "driver.json").read_text())
        driver_state["config"]["model"]["path"] = str(tmp_path / "no-such-base")
        (step_dir / "driver.json").write_text(json.dumps(driver_state))

    checkpoint = _recommitted(runs["tied"], tmp_path, base_moved_away)
    out_dir = export_checkpoint(checkpoint, tmp_path / "exported")
    _assert_same_weights(out_dir, runs["tied"] / "live_hf", None)
    assert AutoTokenizer.from_pretrained(out_dir).chat_template


def test_a_checkpoint_of_another_model_or_a_risky_destination_is_refused(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    # The same tensors, filed with the config of a wider model.
    other = build_checkpoint(tmp_path / "wider", "qwen2", False, hidden_size=128)

    def wider_config(step_dir: Path) -> None:
        shutil.copy(other / "config.json", step_dir / MODEL_FILES_DIR / "config.json")

    checkpoint = _recommitted(runs["untied"], tmp_path, wider_config)
    with pytest.raises(CheckpointError, match=r"policy/shapes\.json: .* belongs to another model"):
        export_checkpoint(checkpoint, tmp_path / "exported")
    assert not (tmp_path / "exported").exists()

    # A checkpoint without the base's files names what is missing.
    checkpoint = _recommitted(
        runs["untied"], tmp_path, lambda step_dir: shutil.rmtree(step_dir / MODEL_FILES_DIR)
    )
    with pytest.raises(CheckpointError, match=rf"{MODEL_FILES_DIR}/config\.json is missing"):
        export_checkpoint(checkpoint, tmp_path / "exported")

    # Replacing a directory that is not an HF model (say `--to .`) would destroy it.
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not an HF model"):
        export_checkpoint(_checkpoint(runs["untied"]), tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_a_weight_redeclared_as_a_pickle_is_refused_before_it_is_unpickled(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    checkpoint = _recommitted(
        runs["untied"],
        tmp_path,
        lambda step_dir: redeclare_as_pickle(step_dir / "policy", EMBEDDING, marker),
    )
    verify(checkpoint)  # whoever wrote the metadata wrote the manifest too
    out_dir = tmp_path / "exported"
    result = _export(checkpoint, out_dir)
    assert result.returncode == 2, result.stderr
    metadata = checkpoint / "policy" / ".metadata"
    assert f"{metadata} declares {EMBEDDING} as BytesStorageMetadata" in result.stderr
    assert not marker.exists()
    assert not out_dir.exists()


def test_a_shard_outside_the_checkpoint_is_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"

    def shards_elsewhere(step_dir: Path) -> None:
        # Real shards, which a reader that follows the path loads without complaint.
        shutil.copytree(step_dir / "policy", outside)
        relocate_shards(step_dir / "policy", EMBEDDING, f"{outside}/")

    checkpoint = _recommitted(runs["untied"], tmp_path, shards_elsewhere)
    metadata = re.escape(str(checkpoint / "policy" / ".metadata"))
    with pytest.raises(CheckpointError, match=rf"{metadata} places {EMBEDDING} in .* outside"):
        export_checkpoint(checkpoint, tmp_path / "exported")
    assert not (tmp_path / "exported").exists()
