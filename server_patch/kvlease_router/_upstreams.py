"""Prefill and decode pools: least-outstanding choice, decode affinity, passive+active health.

Sans-IO: the pools take ``now`` and never do IO; the app's health task and the turn flow report
what they saw (``mark_down`` on a connection failure, ``mark_up`` on a good probe).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvlease.protocol import ControlInfo
from kvlease_router._settings import NodeSpec

__all__ = ["Node", "Pool", "Upstreams"]


@dataclass
class Node:
    url: str
    control: str | None
    role: str
    outstanding: int = 0
    down_until: float = 0.0
    info: ControlInfo | None = None
    model: str | None = None
    version: str | None = None
    served: int = 0
    failures: int = 0
    probe_failures: int = 0

    def healthy(self, now: float) -> bool:
        return now >= self.down_until

    def describe(self, now: float) -> dict[str, object]:
        return {
            "url": self.url,
            "control": self.control,
            "healthy": self.healthy(now),
            "outstanding": self.outstanding,
            "served": self.served,
            "failures": self.failures,
            "model": self.model,
            "vllm_version": self.version,
            "info": None if self.info is None else self.info.to_json(),
        }


@dataclass
class Pool:
    role: str
    nodes: list[Node]
    _rr: Iterator[int] = field(default_factory=lambda: itertools.count())

    def by_url(self, url: str | None) -> Node | None:
        if url is None:
            return None
        for n in self.nodes:
            if n.url == url:
                return n
        return None

    def pick(self, now: float, prefer: str | None = None, exclude: Iterable[Node] = ()) -> Node:
        """``prefer`` (affinity) if healthy, else the healthy node with the fewest outstanding
        requests (ties rotate); with no healthy node, the least-loaded one (it may have recovered)."""
        nodes = self.nodes
        if len(nodes) == 1:  # every rule below picks the only node (even an excluded, unhealthy one)
            return nodes[0]
        excluded = {id(n) for n in exclude}
        preferred = self.by_url(prefer)
        if preferred is not None and preferred.healthy(now) and id(preferred) not in excluded:
            return preferred
        candidates = [n for n in self.nodes if id(n) not in excluded] or self.nodes
        healthy = [n for n in candidates if n.healthy(now)] or candidates
        if len(healthy) == 1:
            return healthy[0]
        low = min(n.outstanding for n in healthy)
        best = [n for n in healthy if n.outstanding == low]
        return best[next(self._rr) % len(best)]

    def using(self, node: Node) -> _Using:
        """``with pool.using(node):`` counts a request outstanding on ``node`` while it runs."""
        return _Using(node)


class _Using:
    """The context of :meth:`Pool.using` (a plain class: cheaper per request than a generator)."""

    __slots__ = ("node",)

    def __init__(self, node: Node) -> None:
        self.node = node

    def __enter__(self) -> Node:
        self.node.outstanding += 1
        return self.node

    def __exit__(self, *exc: object) -> None:
        self.node.outstanding -= 1
        self.node.served += 1


class Upstreams:
    """The prefill and decode pools of one router."""

    def __init__(self, prefill: Iterable[NodeSpec], decode: Iterable[NodeSpec], unhealthy_for: float = 5.0):
        self.prefill = Pool("prefill", [Node(s.url, s.control, "prefill") for s in prefill])
        self.decode = Pool("decode", [Node(s.url, s.control, "decode") for s in decode])
        self.unhealthy_for = unhealthy_for

    def all(self) -> list[Node]:
        return self.prefill.nodes + self.decode.nodes

    def mark_down(self, node: Node, now: float) -> None:
        node.down_until = now + self.unhealthy_for
        node.failures += 1

    @staticmethod
    def mark_up(node: Node) -> None:
        node.down_until = 0.0

    def decode_by_control(self, control: str | None) -> Node | None:
        for n in self.decode.nodes:
            if control is not None and n.control == control:
                return n
        return None
