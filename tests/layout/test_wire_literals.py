"""The wire contract is spelled once: in ``kvlease.protocol``.

A header name, path, status value or wire key that ``kvlease.protocol`` defines must not be written as
a string literal anywhere else in the shipped sources (``sdk/``, ``integrations/``, ``server_patch/``):
import the constant instead (``protocol.HEADER_STATUS``, ``from kvlease.protocol import KV``).

Docstrings and f-string pieces are never checked. What counts, by the kind and shape of the value:

- header names (compared case-insensitively), paths (``/...``), and every other value with a
  character outside ``a-z0-9_`` (``no-id``, ``stock-vllm``, ``data: [DONE]``): any string or bytes
  literal; so are status values with an underscore (``upstream_error``);
- keys with an underscore (``kv_transfer_params``, ``do_remote_decode``, ``conversation_id``), which
  are also Python identifiers: where a key goes (a dict key, a subscript, the first argument of
  ``.get`` / ``.pop`` / ``.setdefault`` / ``itemgetter``, the left side of ``in``, an element of a
  tuple, list or set literal other than ``__slots__``); as a dict key, one that is not a
  ``kv_transfer_params`` key only beside another protocol key (a report may have its own
  ``reused_tokens``);
- plain lower-case words, which are also ordinary words, only where they are wire:
  a status value (``hit``, ``off``, ``unknown``: the members of the protocol's enums and the
  ``REUSE_`` / ``LEASE_`` / ``HEALTH_`` / ``MODE_`` constants) compared with, or stored under, a
  protocol key (``x.status == "hit"``, ``{"status": "ok"}``, ``{HEADER_REUSE: "off"}``); a key
  (``status``, ``ts``, ``reasoning``) as a dict key beside another protocol key; a
  ``kv_transfer_params`` key (``kvlease``, ``reuse``) also as a subscript, ``.get`` or ``in``.

``_SHARED`` lists the values a protocol constant shares with another contract, where the literal
means that other contract; each says why.
"""

from __future__ import annotations

import ast
import enum
import importlib
import pkgutil
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, is_dataclass
from pathlib import Path

import kvlease.protocol

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("sdk", "integrations", "server_patch")
PROTOCOL_DIR = Path(kvlease.protocol.__file__).resolve().parent

#: Values of protocol constants that another contract spells the same way, not checked.
_SHARED = {
    # OpenAI's ``usage`` object has these keys too; the turn log took its names from it.
    "prompt_tokens": "OpenAI usage key",
    "completion_tokens": "OpenAI usage key",
}
_VALUE_PREFIXES = ("REUSE_", "LEASE_", "HEALTH_", "MODE_", "ERROR_")
_KV_PREFIXES = ("KV", "PREFILL_", "CACHE_SALT")
_KEY_CALLS = frozenset({"get", "pop", "setdefault", "itemgetter"})
_PLAIN = re.compile(r"[a-z]+")
_IDENTIFIER = re.compile(r"[a-z][a-z0-9_]*")


@dataclass
class Wire:
    """The protocol's literals, by how they are checked (each maps to a protocol name)."""

    headers: dict[str, str] = field(default_factory=dict)  # lower-cased header name
    strict: dict[str, str] = field(default_factory=dict)  # any literal
    kv_keys: dict[str, str] = field(default_factory=dict)  # kv_transfer_params keys: where a key goes
    keys: dict[str, str] = field(default_factory=dict)  # other identifier keys: ... beside a key in a dict
    kv_words: dict[str, str] = field(default_factory=dict)  # plain kv_transfer_params keys
    words: dict[str, str] = field(default_factory=dict)  # other plain keys: dict key beside a key
    values: dict[str, str] = field(default_factory=dict)  # plain status values: beside a key
    all_keys: set[str] = field(default_factory=set)  # every protocol key, for "beside a key"
    names: set[str] = field(default_factory=set)  # the protocol's constant names (HEADER_STATUS, KVLEASE)


def _protocol_constants() -> Iterator[tuple[str, str]]:
    """``(protocol name, value)`` of every string constant kvlease.protocol defines; class
    attributes and enum members first, then module constants, then elements of tuples."""
    modules = [kvlease.protocol] + [
        importlib.import_module(f"kvlease.protocol.{m.name}")
        for m in pkgutil.iter_modules(kvlease.protocol.__path__)
    ]
    found: list[tuple[int, str, str]] = []
    for mod in modules:
        for name, value in vars(mod).items():
            if name.startswith("__"):
                continue
            if isinstance(value, str):
                found.append((1, name, value))
            elif isinstance(value, (tuple, frozenset)) and all(isinstance(v, str) for v in value):
                found.extend((2, f"{name}[{i}]", v) for i, v in enumerate(value))
            elif isinstance(value, type) and value.__module__ == mod.__name__ and not is_dataclass(value):
                if issubclass(value, enum.Enum):
                    found.extend((0, f"{name}.{m.name}", m.value) for m in value if isinstance(m.value, str))
                else:
                    found.extend(
                        (0, f"{name}.{a}", v)
                        for a, v in vars(value).items()
                        if not a.startswith("_") and isinstance(v, str)
                    )
    for _, name, value in sorted(found, key=lambda t: t[0]):
        yield name, value


def wire() -> Wire:
    enums = {
        f"{name}.{m.name}"
        for name, cls in vars(kvlease.protocol).items()
        if isinstance(cls, type) and issubclass(cls, enum.Enum)
        for m in cls
    }
    out = Wire()
    constants = list(_protocol_constants())
    # kv_transfer_params keys, less those the turn log shares as a key (``reused_tokens``)
    kv = {v for n, v in constants if n.startswith(_KV_PREFIXES)} - {
        v for n, v in constants if not n.startswith(_KV_PREFIXES + _VALUE_PREFIXES) and n not in enums
    }
    for name, value in constants:
        out.names.add(name.split(".")[-1].split("[")[0])
        if value in _SHARED or not value:
            continue
        is_value = name in enums or name.startswith(_VALUE_PREFIXES)
        if "HEADER" in name.split(".")[0].split("[")[0]:
            out.headers.setdefault(value.lower(), name)
        elif value.startswith("/") or not _IDENTIFIER.fullmatch(value) or (is_value and "_" in value):
            out.strict.setdefault(value, name)
        elif is_value:
            out.values.setdefault(value, name)
        else:
            out.all_keys.add(value)
            if not _PLAIN.fullmatch(value):
                (out.kv_keys if value in kv else out.keys).setdefault(value, name)
            elif value in kv:
                out.kv_words.setdefault(value, name)
            else:
                out.words.setdefault(value, name)
    return out


def _is_key_spot(node: ast.AST, parent: ast.AST | None, grand: ast.AST | None) -> bool:
    """``node`` is where a key goes: a dict key, a subscript, ``.get(node)``, ``node in x``."""
    if isinstance(parent, ast.Dict):
        return any(k is node for k in parent.keys)
    if isinstance(parent, ast.Subscript):
        return parent.slice is node
    if isinstance(parent, ast.Call):
        f = parent.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        return name in _KEY_CALLS and bool(parent.args) and parent.args[0] is node
    if isinstance(parent, ast.Compare):
        return parent.left is node and isinstance(parent.ops[0], (ast.In, ast.NotIn))
    return False


def _in_sequence(parent: ast.AST | None, grand: ast.AST | None) -> bool:
    if not isinstance(parent, (ast.Tuple, ast.List, ast.Set)):
        return False
    slots = isinstance(grand, (ast.Assign, ast.AnnAssign)) and any(
        isinstance(t, ast.Name) and t.id == "__slots__"
        for t in (grand.targets if isinstance(grand, ast.Assign) else [grand.target])
    )
    return not slots


def _names_key(expr: ast.AST, contract: Wire) -> bool:
    """``expr`` reads or names a protocol key: ``x.status``, ``status``, ``d["reuse"]``,
    ``d.get("status")``, ``HEADER_STATUS``, ``protocol.KV.KVLEASE``."""
    if isinstance(expr, ast.Constant):
        return isinstance(expr.value, str) and (
            expr.value in contract.all_keys or expr.value.lower() in contract.headers
        )
    if isinstance(expr, ast.Attribute):
        return expr.attr in contract.all_keys or expr.attr in contract.names
    if isinstance(expr, ast.Name):
        return expr.id in contract.all_keys or expr.id in contract.names
    if isinstance(expr, ast.Subscript):
        return _names_key(expr.slice, contract)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr in _KEY_CALLS:
        return bool(expr.args) and _names_key(expr.args[0], contract)
    return False


def _beside_a_key(node: ast.AST, parent: ast.AST | None, grand: ast.AST | None, contract: Wire) -> bool:
    """A status value compared with, or stored under, a protocol key."""
    if isinstance(parent, (ast.Tuple, ast.List, ast.Set)) and isinstance(grand, ast.Compare):
        node, parent = parent, grand  # ``x.status in ("hit", "miss")``
    if isinstance(parent, ast.Compare):
        operands = [parent.left, *parent.comparators]
        return any(_names_key(o, contract) for o in operands if o is not node)
    if isinstance(parent, ast.Dict):
        return any(
            v is node and k is not None and _names_key(k, contract)
            for k, v in zip(parent.keys, parent.values)
        )
    return False


def _has_key_sibling(node: ast.AST, parent: ast.AST | None, contract: Wire) -> bool:
    return (
        isinstance(parent, ast.Dict)
        and any(k is not None and k is not node and _names_key(k, contract) for k in parent.keys)
        and any(k is node for k in parent.keys)
    )


def _skipped(tree: ast.AST) -> set[int]:
    """ids of the string statements (docstrings and other bare strings) and f-string pieces."""
    out = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }
    out |= {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    return out


def violations(source: str, contract: Wire) -> list[tuple[int, str, str]]:
    """``(line, literal, protocol name)`` for each protocol literal spelled in ``source``."""
    tree = ast.parse(source)
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    skip = _skipped(tree)
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or id(node) in skip:
            continue
        raw = node.value
        if isinstance(raw, bytes):
            text = raw.decode("latin-1")
        elif isinstance(raw, str):
            text = raw
        else:
            continue
        parent = parents.get(id(node))
        grand = parents.get(id(parent)) if parent is not None else None
        name = contract.headers.get(text.lower()) or contract.strict.get(text)
        if name is None and isinstance(raw, str):
            if text in contract.kv_keys and (
                _is_key_spot(node, parent, grand) or _in_sequence(parent, grand)
            ):
                name = contract.kv_keys[text]
            elif text in contract.keys and (_is_key_spot(node, parent, grand) or _in_sequence(parent, grand)):
                if not isinstance(parent, ast.Dict) or _has_key_sibling(node, parent, contract):
                    name = contract.keys[text]
            elif text in contract.kv_words and _is_key_spot(node, parent, grand):
                if not isinstance(parent, ast.Dict) or _has_key_sibling(node, parent, contract):
                    name = contract.kv_words[text]
            elif text in contract.words and _has_key_sibling(node, parent, contract):
                name = contract.words[text]
            elif text in contract.values and _beside_a_key(node, parent, grand, contract):
                name = contract.values[text]
        if name is not None:
            found.append((node.lineno, text, name))
    return sorted(found)


def _sources() -> Iterator[Path]:
    for root in SOURCE_ROOTS:
        for path in sorted((ROOT / root).rglob("*.py")):
            if PROTOCOL_DIR not in path.resolve().parents:
                yield path


def test_no_wire_literal_outside_the_protocol() -> None:
    contract = wire()
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {text!r} is kvlease.protocol.{name}"
        for path in _sources()
        for line, text, name in violations(path.read_text(encoding="utf-8"), contract)
    ]
    assert not bad, "spell these with the kvlease.protocol constant:\n" + "\n".join(bad)


def test_the_checker_catches_planted_literals() -> None:
    contract = wire()
    planted = '''
"""A docstring may say X-KVLease-Status, kv_transfer_params and hit."""
def f(headers, body, status, kv, x, cid, HEADER_REUSE):
    a = headers["x-kvlease-status"]             # header name, any case
    b = body.get("kv_transfer_params")          # identifier key
    c = status == "hit"                         # status value compared with a key
    d = {"ts": 1.0, "conversation_id": cid}     # plain key beside a key
    e = kv["kvlease"]                           # plain kv_transfer_params key
    f = b"data: [DONE]\\n\\n"
    g = "/v1/kvlease/renew"
    h = {HEADER_REUSE: "off"}                   # status value under a protocol constant
    i = x.status in ("miss", "first")
    j = ("do_remote_decode", "remote_host")     # keys listed for a loop
    return a, b, c, d, e, f, g, h, i, j
'''
    got = {(line, text) for line, text, _ in violations(planted, contract)}
    assert got == {
        (4, "x-kvlease-status"),
        (5, "kv_transfer_params"),
        (6, "hit"),
        (7, "ts"),
        (7, "conversation_id"),
        (8, "kvlease"),
        (9, "data: [DONE]\n\n"),
        (10, "/v1/kvlease/renew"),
        (11, "off"),
        (12, "miss"),
        (12, "first"),
        (13, "do_remote_decode"),
        (13, "remote_host"),
    }


def test_ordinary_words_are_not_wire() -> None:
    contract = wire()
    fine = """
class Slots:
    __slots__ = ("conversation_id", "reused_tokens", "status")
def f(log, counts, x, policy, block, validator):
    log.info("hit the limit: off by one")       # prose
    counts["error"] += 1                        # a status word as an ordinary key
    y = {"line": 3, "error": "bad"}             # ... and as a dict key
    z = policy != "off" and x.connector == "kvlease"
    style = {"kvlease": "green", "no-data": "bold"}
    text = block["reasoning"]                   # not beside a protocol key
    validator("conversation_id")                # a field name passed to a call
    return f"status={x}", "reuse", y, z, style, text
"""
    assert violations(fine, contract) == []


def test_the_contract_is_collected() -> None:
    contract = wire()
    assert contract.headers["x-kvlease-status"] == "HEADER_STATUS"
    assert contract.kv_keys["kv_transfer_params"] == "KV_TRANSFER_PARAMS"
    assert contract.keys["gap_s"] == "TurnLogKey.GAP_S"
    assert contract.strict["no-id"] == "ReuseStatus.NO_ID"
    assert contract.values["hit"] == "ReuseStatus.HIT"
    assert contract.kv_words["kvlease"] == "KV.KVLEASE"
    assert "reasoning" in contract.words and "reasoning_content" in contract.keys
