"""The CPU demo recipe submitted with `ray job submit` to a real two-node Ray cluster, and a
rollout worker lost in the middle of a cross-node weight sync.

Both nodes run on this machine (`ray start --head` and `ray start --address`), with their
own CPUs: 1 on the head, 2 on the second node. A split placement with two devices per node
can only put the 2-rank trainer group on the second node and the rollout worker on the head,
so the weights cross nodes (the gloo transport), as they would between machines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from rl.checkpoint.store import verify
from tests.helpers.models import build_checkpoint
from tests.helpers.ports import free_ports
from tests.helpers.repo import REPO
from tests.helpers.tiny_runs import tiny_run_tree

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent  # the environment's `ray` and `rl`


def _ray(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "ray"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@dataclass
class Cluster:
    env: dict[str, str]  # reaches the cluster: RAY_ADDRESS is the dashboard, for `ray job`
    head: str  # the head's GCS address, as `rl train --address` takes it


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head node (1 CPU) and a second node (2 CPUs), stopped after the module's tests
    however they end."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_USAGE_STATS_ENABLED": "0"}
    # Ray 2.60's head enables token auth and writes ~/.ray/auth_token; every other node and
    # client must be told to present it.
    env["RAY_AUTH_MODE"] = "token"
    env.pop("RAY_ADDRESS", None)
    gcs, dashboard = free_ports(2)
    common = ["--object-store-memory=300000000", "--disable-usage-stats"]
    try:
        head = _ray(
            "start", "--head", f"--port={gcs}", "--num-cpus=1", "--include-dashboard=true",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", *common, env=env,
        )  # fmt: skip
        assert head.returncode == 0, head.stdout + head.stderr
        node = _ray("start", f"--address=127.0.0.1:{gcs}", "--num-cpus=2", *common, env=env)
        assert node.returncode == 0, node.stdout + node.stderr
        yield Cluster({**env, "RAY_ADDRESS": f"http://127.0.0.1:{dashboard}"}, f"127.0.0.1:{gcs}")
    finally:
        _ray("stop", "--force", env=env)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GRPO recipe, split over the two nodes; its base model, data and runs live
    outside the job's working directory, as on shared storage (the first run builds the base)."""
    root = tmp_path_factory.mktemp("cluster")
    tree = tiny_run_tree(
        root / "shared",
        root / "runs",
        "cluster",
        scheduler={"placement": "split", "rollout_devices": 1, "devices_per_node": 2},
        run={"export_hf": False},
    )
    path = root / "cluster.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_ray_job_submit_runs_the_recipe_across_two_nodes(cluster: Cluster, recipe: Path) -> None:
    submitted = subprocess.run(
        [
            str(BIN / "ray"),
            "job",
            "submit",
            "--submission-id",
            "tandem-cluster-test",
            "--runtime-env",
            str(REPO / "recipes" / "runtime_env.yaml"),
            "--working-dir",
            str(REPO),
            "--",
            "rl",
            "train",
            str(recipe),
        ],  # fmt: skip
        cwd=REPO,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    logs = submitted.stdout + submitted.stderr
    assert submitted.returncode == 0, logs[-4000:]
    assert "Job 'tandem-cluster-test' succeeded" in logs, logs[-4000:]
    assert "checkpoint written to" in logs  # the driver's output streamed back
    assert "weight sync: distributed transport, trainer and rollout on 2 node(s)" in logs

    run_dir = recipe.parent / "runs" / "cluster"
    assert verify(run_dir / "checkpoints" / "step_000002")["step"] == 2
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]

    listed = _ray(
        "list", "actors", "--detail", "--format=json", "--limit=100",
        f"--address={cluster.env['RAY_ADDRESS']}", env=cluster.env,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    nodes: dict[str, set[str]] = {}
    for actor in json.loads(listed.stdout):
        nodes.setdefault(actor["class_name"], set()).add(actor["node_id"])
    assert len(nodes["TrainWorker"]) == 1 and len(nodes["RolloutWorker"]) == 1, nodes
    assert nodes["TrainWorker"] != nodes["RolloutWorker"], nodes


def test_rl_train_with_address_joins_the_running_cluster(cluster: Cluster, recipe: Path) -> None:
    env = {k: v for k, v in cluster.env.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [str(BIN / "rl"), "train", str(recipe), "--address", cluster.head, "run.name=direct",
         "run.num_steps=1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"joined the Ray cluster at {cluster.head}: 3 CPUs, 0 GPUs, 2 node(s)" in result.stdout
    assert "trainer and rollout on 2 node(s)" in result.stdout
    assert verify(recipe.parent / "runs" / "direct" / "checkpoints" / "step_000001")


def test_a_failing_job_reports_failure_through_its_exit_status(
    cluster: Cluster, tmp_path: Path
) -> None:
    # The driver refuses the recipe (no such model) before any work: the job fails, visibly.
    recipe = tmp_path / "broken.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"path": str(tmp_path / "no-model")}}))
    submitted = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--working-dir", str(tmp_path), "--", "rl", "train",
         str(recipe)],
        env=cluster.env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    logs = submitted.stdout + submitted.stderr
    assert submitted.returncode != 0, logs[-3000:]
    assert "model.path=" in logs and "does not exist" in logs, logs[-3000:]
    assert "failed" in logs


def test_a_rollout_worker_lost_during_a_cross_node_sync_is_replaced_and_synced(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The gloo group spanning both nodes breaks when its rollout member dies mid-sync: the
    driver stops the stream there, re-forms the group with a fresh engine and sends the
    version whole, well before gloo's 10-minute timeout; the engine then scores as the
    trainer does."""
    model_dir = build_checkpoint(tmp_path / "model", "qwen2", False)
    env = {k: v for k, v in cluster.env.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.helpers.cross_node_sync", cluster.head, str(model_dir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert (outcome["transport"], outcome["num_nodes"]) == ("distributed", 2)
    assert outcome["failed"] == [0] and outcome["replaced"]
    assert outcome["streamed"] < outcome["num_buckets"]  # stopped at the loss
    assert outcome["versions"] == [1]
    assert outcome["gap"] < 1e-4
    assert outcome["seconds"] < 300  # a hang guard, far below gloo's timeout
