"""The layering the README promises, checked over every module's imports (static, by AST):
rollout/ and trainer/ use only rl's config, data contracts, sync plan and transports, and
observability; the run loop reaches transports only through rl.sync's contract; and no module
imports itself through others, so each layer imports only below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.repo import REPO

# What the inference and training sides may import of the controller (rl.expert_routing: the
# router hooks both sides put on a mixture of experts); rl.agents is the
# episode logic the rollout workers run (itself a leaf, below); rl.shm_owners names the files
# a process leaves in /dev/shm (a leaf); rl.sandbox takes the run's sandbox policy (an agent's
# tools and environment run in the rollout workers' sandboxes).
_ALLOWED_FROM_RL = (
    "rl.config",
    "rl.types",
    "rl.expert_routing",
    "rl.sync.plan",
    "rl.sync.transport",
    "rl.observe",
    "rl.agents",
    "rl.shm_owners",
    "rl.sandbox",
)
_AGENTS_MAY_IMPORT = (
    "rl.agents",
    "rl.config",
    "rl.types",
    "rl.sandbox",
    "rl.isolation",
    "rl.user_code",
)
_LAYERED = ("rl", "rollout", "trainer", "kernels")
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


def _module_names(root: Path, packages: tuple[str, ...]) -> dict[str, bool]:
    """Every module of `packages` under `root`, by dotted name: whether it is a package."""
    names = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            names[".".join(parts[:-1] if is_package else parts)] = is_package
    return names


def _import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}, over every import statement anywhere in the file
    (module level, under `if TYPE_CHECKING`, inside functions), relative ones resolved. An
    import names the module it loads, not the packages Python loads before it: a package
    whose `__init__` imports its submodules is not in a cycle with them."""
    names = _module_names(root, packages)

    def known(name: str) -> str | None:  # the module itself, or the one defining the name
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, is_package in names.items():
        path = root / module.replace(".", "/")
        path = path / "__init__.py" if is_package else path.with_suffix(".py")
        package = module if is_package else module.rpartition(".")[0]
        edges = graph[module] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    source = ".".join([*base, source] if source else base)
                # `from package import submodule` loads the submodule too.
                targets = [source, *(f"{source}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in map(known, targets):
                if target is not None and target != module:
                    edges.setdefault(target, node.lineno)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
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


def test_the_cycle_check_sees_imports_in_functions_and_type_checking_blocks(
    tmp_path: Path,
) -> None:
    files = {
        # A registry filled by its package's __init__: no cycle.
        "pkg/__init__.py": "from pkg import entry\nfrom pkg.registry import REGISTRY\n",
        "pkg/registry.py": "REGISTRY = {}\n",
        "pkg/entry.py": "from pkg.registry import REGISTRY\n",
        # A cycle closed by an import inside a function.
        "pkg/a.py": "from pkg.b import f\n",
        "pkg/b.py": "def f():\n    from pkg import a\n",
        # A cycle closed by a relative import under TYPE_CHECKING.
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from pkg.sub.d import D\n",
        "pkg/sub/d.py": "if TYPE_CHECKING:\n    from .c import C\nD = 1\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    cycles = _cycles(_import_graph(tmp_path, ("pkg",)))
    assert sorted(cycles) == [["pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d"]]


def test_no_module_imports_itself_through_others() -> None:
    graph = _import_graph(REPO, _LAYERED)
    cycles = _cycles(graph)
    described = [
        "; ".join(
            f"{a} -> {b} (line {line})" for a in cycle for b, line in graph[a].items() if b in cycle
        )
        for cycle in cycles
    ]
    assert not cycles, "\n".join(described)
