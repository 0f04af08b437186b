"""The package layout: one package per process, no import cycles, the router free of vLLM.

Imports are read with ``ast`` from the sources, function-level imports included (a lazy import is
still a dependency), so a cycle that only shows at run time is caught here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: package -> its root folder.
PACKAGES = {
    "kvlease": ROOT / "sdk" / "kvlease",
    "kvlease_langchain": ROOT / "integrations" / "kvlease_langchain",
    "kvlease_vllm": ROOT / "server_patch" / "kvlease_vllm",
    "kvlease_router": ROOT / "server_patch" / "kvlease_router",
    "kvlease_stack": ROOT / "server_patch" / "kvlease_stack",
}
#: What each package may import among the project's packages (the design's "must not import").
ALLOWED = {
    "kvlease": set(),
    "kvlease_langchain": {"kvlease"},
    "kvlease_vllm": {"kvlease"},
    "kvlease_router": {"kvlease"},
    "kvlease_stack": {"kvlease", "kvlease_vllm", "kvlease_router"},
}
#: The one module allowed to break the rule: the deprecated alias, removed next release.
ALIASES = {ROOT / "server_patch" / "kvlease_vllm" / "router.py"}


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif (  # importlib.import_module("pkg.mod") with a literal name
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value.split(".")[0])
    return found


def _graph() -> dict[str, dict[str, list[str]]]:
    """package -> {imported project package -> [files that import it]}."""
    graph: dict[str, dict[str, list[str]]] = {name: {} for name in PACKAGES}
    for name, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            if path in ALIASES:
                continue
            for dep in _imported_packages(path) & PACKAGES.keys() - {name}:
                graph[name].setdefault(dep, []).append(str(path.relative_to(ROOT)))
    return graph


def test_no_import_cycles_between_packages() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in graph[node]:
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep) :], dep]
                pytest.fail("import cycle: " + " -> ".join(cycle) + f" (via {graph[node][dep]})")
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_package_imports_only_what_its_process_may(package: str) -> None:
    extra = {dep: files for dep, files in _graph()[package].items() if dep not in ALLOWED[package]}
    assert not extra, f"{package} imports {extra}"


def test_cycle_detection_sees_lazy_imports(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text(
        "def f():\n    from kvlease_vllm import x\n    importlib.import_module('kvlease_router.cli')\n"
    )
    assert {"kvlease_vllm", "kvlease_router"} <= _imported_packages(mod)


def _blocking(*packages: str) -> str:
    """Python code that makes importing any of ``packages`` (or their modules) fail."""
    return textwrap.dedent(
        f"""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {packages!r}:
                    raise ImportError(f"blocked for this test: {{name}}")
                return None
        sys.meta_path.insert(0, Block())
        """
    )


BLOCK_HEAVY = _blocking("vllm", "nixl", "torch", "kvlease_vllm", "kvlease_stack")


def test_router_runs_without_vllm() -> None:
    """The whole router (app, stores, CLI) imports with vLLM, NIXL, torch and the other server
    packages blocked, and builds its app."""
    code = BLOCK_HEAVY + textwrap.dedent(
        """
        import kvlease_router
        from kvlease_router import MemoryStore, NodeSpec, RouterSettings, create_app
        import kvlease_router.cli, kvlease_router._redis_store
        app = create_app(
            RouterSettings(prefill=(NodeSpec("http://127.0.0.1:9"),), decode=(NodeSpec("http://127.0.0.1:9"),)),
            MemoryStore(),
        )
        print("ok", type(app).__name__)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok Application"


def test_the_protocol_runs_inside_vllm_without_the_sdks_dependencies() -> None:
    """The connector runs inside vLLM's environment, with only the ``connector`` extra installed:
    ``kvlease`` and ``kvlease.protocol`` import there (the SDK's own dependencies blocked) and
    parse a renew body."""
    code = _blocking("orjson", "tenacity", "typer", "rich", "openai") + textwrap.dedent(
        """
        import kvlease
        from kvlease import __version__, protocol
        print(protocol.RenewRequest.from_json({"conversation_ids": ["a", "b"]}).conversation_ids)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "('a', 'b')"


def test_deprecated_router_alias() -> None:
    sys.modules.pop("kvlease_vllm.router", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import kvlease_vllm.router as alias
    assert any(
        issubclass(w.category, DeprecationWarning) and "import kvlease_router" in str(w.message)
        for w in caught
    )
    import kvlease_router

    assert alias.RouterSettings is kvlease_router.RouterSettings
    assert alias.create_app is kvlease_router.create_app
    assert sorted(alias.__all__) == sorted(kvlease_router.__all__)


def test_cli_names_no_server_package() -> None:
    """The SDK's shell finds sub-commands through entry points, and every registered one loads."""
    from kvlease import cli

    names = {ep.name: ep.value for ep in cli.commands()}
    assert {"analyze", "demo", "router", "stack"} <= names.keys()
    assert names["router"].startswith("kvlease_router.")
    assert names["stack"].startswith("kvlease_stack.") and names["demo"].startswith("kvlease_stack.")
    for ep in cli.commands():
        assert ep.load() is not None
    source = (PACKAGES["kvlease"] / "cli.py").read_text()
    for server_pkg in ("kvlease_vllm", "kvlease_router", "kvlease_stack"):
        assert server_pkg not in source
