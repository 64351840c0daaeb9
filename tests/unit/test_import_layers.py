"""The layering the README promises, checked over every module's imports (static, by AST):
rollout/ and trainer/ use only rl's config, data contracts, sync plan and transports, and
observability; the run loop reaches transports only through rl.sync's contract."""

from __future__ import annotations

import ast

import pytest

from tests.helpers.repo import REPO

# What the inference and training sides may import of the controller; rl.agents is the
# episode logic the rollout workers run (itself a leaf, below); rl.shm_owners names the files
# a process leaves in /dev/shm (a leaf).
_ALLOWED_FROM_RL = (
    "rl.config",
    "rl.types",
    "rl.sync.plan",
    "rl.sync.transport",
    "rl.observe",
    "rl.agents",
    "rl.shm_owners",
)
_AGENTS_MAY_IMPORT = ("rl.agents", "rl.config", "rl.types", "rl.sandbox", "rl.user_code")
_TRANSPORTS = (
    "rl.sync.shared_memory",
    "rl.sync.distributed",
    "rl.sync.peer_group",
    "rl.sync.pieces",
)


def _imports(package: str) -> list[tuple[str, str]]:
    """(file, imported module) for every absolute import in the package's files."""
    found = []
    for path in sorted((REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((str(path.relative_to(REPO)), node.module))
            elif isinstance(node, ast.Import):
                found += [(str(path.relative_to(REPO)), alias.name) for alias in node.names]
    return found


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("package", ["rollout", "trainer"])
def test_the_inference_and_training_sides_import_only_the_controllers_contracts(
    package: str,
) -> None:
    imports = _imports(package)
    assert any(module.startswith("rl.") for _, module in imports)  # the check sees them
    outside = [
        (file, module)
        for file, module in imports
        if _within(module, ("rl",)) and not _within(module, _ALLOWED_FROM_RL)
    ]
    assert not outside, outside


def test_the_agents_package_stays_a_leaf_the_rollout_workers_can_import() -> None:
    imports = _imports("rl/agents")
    assert any(module.startswith("rl.") for _, module in imports)
    outside = [
        (file, module)
        for file, module in imports
        if _within(module, ("rl", "rollout", "trainer")) and not _within(module, _AGENTS_MAY_IMPORT)
    ]
    assert not outside, outside


def test_the_run_loop_reaches_transports_only_through_the_sync_contract() -> None:
    reaching = [(f, m) for f, m in _imports("rl/run") if _within(m, _TRANSPORTS)]
    assert not reaching, reaching


def test_the_sync_contract_is_what_the_allowed_list_names() -> None:
    # A renamed module would leave the allow-list above vacuous.
    for module in _ALLOWED_FROM_RL + _TRANSPORTS:
        assert (REPO / module.replace(".", "/")).with_suffix(".py").is_file() or (
            REPO / module.replace(".", "/") / "__init__.py"
        ).is_file(), module
