"""Staged pulls, the pure parts: when to stage, the staging buffer's ranges, the side channel.

A staged pull (issue 18) replaces upstream's READ of one descriptor per (KV region, block) by:
D's worker gathers the leased request's blocks into its registered contiguous staging buffer, P's
worker reads that range with ONE descriptor into its own staging buffer and scatters it into the
request's blocks. On an H200 that took 18.1 ms at 24k tokens of a 32B-class layout where the
per-block READ took 636 ms (``benchmarks/gpu_nixl_pull.json``).

D's engine does not step while it is idle (kvlease holds leased blocks with its own references), so
the gather cannot wait for one: D's worker runs a :class:`StagingServer` thread that answers P's
:class:`~kvlease.protocol._handle.StagingRequest` over TCP (one framed JSON message each way) while
its engine loop sleeps. The vLLM side is ``kvlease_vllm._worker``; this module imports neither
vLLM nor torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvlease._errors import ConfigError
from kvlease.protocol import ProtocolError
from kvlease.protocol._staging import (
    StagingRefusal,
    StagingReply,
    StagingRequest,
    staging_decode,
    staging_frame_length,
)
from kvlease_vllm._config import KVLeaseConfig
from kvlease_vllm._cost import CostModel

logger = logging.getLogger("vllm.kvlease.staging")

OFF: Final = "off"
AUTO: Final = "auto"
ALWAYS: Final = "always"
#: Staging buffer ranges start on this boundary (bytes).
ALIGN: Final = 4096
#: The attribute of upstream's ``NixlConnectorMetadata`` that carries P's staging plans to its
#: workers (request id -> D's staging ports), and of upstream's handshake payload that carries a
#: worker's staging port to its scheduler; both are dropped before upstream reads the object.
PLANS_ATTR: Final = "kvlease_staging"
#: P: request ids whose handle is host-placed (``kvlease.placement``): staged or recomputed, never
#: read block by block (another connector-metadata attribute).
HOST_ONLY_ATTR: Final = "kvlease_host_only"
PORT_ATTR: Final = "kvlease_staging_port"
#: The attribute of the handshake payload that carries where the worker's listener runs:
#: ``(bind host, node name)``.
WHERE_ATTR: Final = "kvlease_staging_where"
#: P's READ of a staged range: at least this long, and this rate at worst (UCX's TCP emulation
#: moves ~0.4 GB/s), past the time D may take to answer; D refuses deadlines beyond the cap.
READ_MIN_S: Final = 10.0
READ_FLOOR_BPS: Final = 2e8
READ_DEADLINE_MAX_S: Final = 600.0
#: D's hold of a range beyond P's READ deadline: clock-rate drift between hosts (far below 0.1 %)
#: and a fixed margin.
HOLD_DRIFT: Final = 1e-3
HOLD_MARGIN_S: Final = 2.0
#: :func:`read_verdict`'s answers.
WAIT: Final = "wait"
SCATTER: Final = "scatter"
LATE: Final = "late"
FAILED: Final = "failed"


def joint_runs(local: Sequence[int], remote: Sequence[int]) -> int:
    """Runs where both sides' block ids advance by one together (what NIXL can merge):
    ``[1, 2, 3] / [7, 8, 20]`` -> 2."""
    runs, last = 0, None
    for pair in zip(local, remote):
        if last is None or pair[0] != last[0] + 1 or pair[1] != last[1] + 1:
            runs += 1
        last = pair
    return runs


def merged_descriptors(
    local_ids: Sequence[Sequence[int]], remote_ids: Sequence[Sequence[int]], regions: int
) -> int:
    """Descriptors of a per-block READ after NIXL merges the ones adjacent on both sides: joint runs
    of each group's paired tail (as upstream pairs them) times the group's KV regions."""
    groups = max(len(local_ids), len(remote_ids), 1)
    per_group = max(regions // groups, 1) if regions > 0 else 0
    total = 0
    for local, remote in zip(local_ids, remote_ids):
        n = min(len(local), len(remote))
        if n:
            total += per_group * joint_runs(local[len(local) - n :], remote[len(remote) - n :])
    return total


@dataclass(frozen=True)
class PathChoice:
    staged: bool
    why: str

    def describe(self) -> str:
        return f"{'staged' if self.staged else 'per-block'} ({self.why})"


def choose_path(
    mode: str,
    *,
    advertised: bool,
    tokens: int,
    capacity_tokens: int,
    descriptors: int,
    min_descriptors: int,
    per_block_s: float,
    staged_s: float,
) -> PathChoice:
    """Whether P's scheduler plans a pull as staged (its worker may still fall back).

    ``advertised``: D's handle names staging ports; ``descriptors``: the per-block READ's merged
    descriptors (:func:`merged_descriptors`); ``per_block_s`` / ``staged_s``: the cost model's
    predictions of both paths."""
    if mode == OFF:
        return PathChoice(False, "staging off")
    if not advertised:
        return PathChoice(False, "D does not advertise staging")
    if tokens > capacity_tokens:
        return PathChoice(False, f"{tokens} tokens exceed the staging buffer ({capacity_tokens})")
    if mode == ALWAYS:
        return PathChoice(True, "staging always")
    if descriptors < min_descriptors:
        return PathChoice(
            False, f"{descriptors} descriptors, below staging_min_descriptors={min_descriptors}"
        )
    if not staged_s < per_block_s:
        return PathChoice(
            False,
            f"staged {staged_s * 1e3:.1f} ms predicted no faster than per-block {per_block_s * 1e3:.1f} ms",
        )
    return PathChoice(
        True,
        f"{descriptors} descriptors: staged {staged_s * 1e3:.1f} ms vs per-block {per_block_s * 1e3:.1f} ms",
    )


def layout_refusal(
    *,
    source_ranks: int,
    tp_ratio: int,
    block_sizes: tuple[int, int],
    kernel_blocks_per_block: tuple[int, int],
    remote_dcp: int,
    groups: tuple[int, int],
    regions_grouped_alike: bool,
    plain_layout: bool,
) -> str | None:
    """P's worker: why this peer's layout cannot be staged (None: it can). Pairs are (P, D).
    ``plain_layout``: one memory type, no permuted or heterogeneous-attention post-processing
    (anything upstream fixes up after its READ, the staged path does not)."""
    checks = (
        (source_ranks != 1, "more than one source rank"),
        (tp_ratio != 1, "heterogeneous TP"),
        (block_sizes[0] != block_sizes[1], "block sizes differ"),
        (kernel_blocks_per_block != (1, 1), "kernel blocks differ from logical ones"),
        (remote_dcp != 1, "decode context parallel"),
        (groups != (1, 1), "more than one KV cache group"),
        (not regions_grouped_alike, "KV region groups differ"),
        (not plain_layout, "mixed memory types or a post-processed layout"),
    )
    return next((why for bad, why in checks if bad), None)


def expect_staged(cfg: KVLeaseConfig, advertised: bool, tokens: int) -> bool:
    """At decision time (P's blocks not allocated yet): whether the pull will likely be staged, so
    the cost model predicts it at the staged rate (the final choice is :func:`plan_pull`'s)."""
    return cfg.staging != OFF and advertised and 0 < tokens <= cfg.staging_max_tokens


def plan_pull(
    cfg: KVLeaseConfig,
    cost: CostModel,
    ports: Sequence[int] | None,
    local_ids: Sequence[Sequence[int]],
    remote_ids: Sequence[Sequence[int]],
    regions: int,
    tokens: int,
) -> PathChoice:
    """P's scheduler, once P's blocks are allocated: the path of a pull of ``tokens`` tokens."""
    return choose_path(
        cfg.staging,
        advertised=bool(ports),
        tokens=tokens,
        capacity_tokens=cfg.staging_max_tokens,
        descriptors=merged_descriptors(local_ids, remote_ids, regions),
        min_descriptors=cfg.staging_min_descriptors,
        per_block_s=cost.predict_pull_s(tokens),
        staged_s=cost.predict_pull_s(tokens, staged=True),
    )


def read_deadline_s(timeout_s: float, nbytes: int) -> float:
    """P: how long after sending a staging request its READ of the staged bytes may end and still
    be used: D's answer (``timeout_s``) plus the READ at :data:`READ_FLOOR_BPS`, at least
    :data:`READ_MIN_S`. Past it P declines the pull (:func:`read_verdict`)."""
    return timeout_s + max(READ_MIN_S, nbytes / READ_FLOOR_BPS)


def range_hold_s(deadline_s: float) -> float:
    """D: how long it keeps a staged range that P has not released, for P's READ deadline
    ``deadline_s``: strictly longer, so D never hands a range out again while P may still use a
    READ of it (D allocates after P sent the request, so D's hold also starts later)."""
    return deadline_s * (1.0 + HOLD_DRIFT) + HOLD_MARGIN_S


def read_verdict(state: str, now: float, read_by: float) -> str:
    """P: what to do with a posted READ of a staged range, in NIXL transfer ``state`` read *before*
    ``now`` (so a READ seen ``DONE`` ended by ``now``) and P's deadline ``read_by``.

    :data:`WAIT` (still running, in time), :data:`SCATTER` (done in time: D still held the range),
    :data:`LATE` (past the deadline, done or not: D may have handed the range out again, so the
    bytes cannot be trusted) or :data:`FAILED` (the READ ended in error)."""
    if state == "PROC":
        return WAIT if now < read_by else LATE
    if state == "DONE":
        return SCATTER if now <= read_by else LATE
    return FAILED


def staging_port(port: int, data_parallel_index: int, tp_size: int, tp_rank: int) -> int:
    """The staging listener's port of one worker: every data-parallel rank takes the next
    ``tp_size`` ports after the one before it (the control port's rule, per TP rank); 0 stays 0
    (any free port)."""
    return port + data_parallel_index * tp_size + tp_rank if port else 0


def take_ports(
    metadata: Mapping[tuple[int, int], Any], host: str | None = None, node: str | None = None
) -> tuple[tuple[int, ...] | None, dict[Any, Any]]:
    """D's scheduler: the staging port of every TP rank, off the workers' handshake payloads, and
    the payloads without it (copies: upstream serves exactly its own fields). The ports are None
    unless every rank of a single pipeline stage has one, and every rank's listener runs where P
    will connect: P reaches all of them at ``host`` (the scheduler's side-channel host), so a rank
    on another node (``node``: this host's name) or bound elsewhere is not advertised."""
    node = socket.gethostname() if node is None else node
    ports: dict[int, int] = {}
    where: dict[int, Any] = {}
    clean: dict[Any, Any] = {}
    for key, payload in metadata.items():
        port = getattr(payload, PORT_ATTR, None)
        if isinstance(port, int) and port > 0:
            ports[key[1]] = port
            where[key[1]] = getattr(payload, WHERE_ATTR, None)
            try:
                payload = dataclasses.replace(payload)  # drops the attributes
            except TypeError:
                for attr in (PORT_ATTR, WHERE_ATTR):
                    if hasattr(payload, attr):
                        delattr(payload, attr)
        clean[key] = payload
    stages = {key[0] for key in metadata}
    if not ports or stages != {0} or sorted(ports) != list(range(len(metadata))):
        return None, clean
    away = {
        r: w
        for r, w in sorted(where.items())
        if not (isinstance(w, tuple) and len(w) == 2 and (host is None or w[0] == host) and w[1] == node)
    }
    if away:
        logger.info(
            "kvlease: staged pulls not advertised: P reaches every rank's listener at %s on %s, but "
            "rank(s) %s listen at %s",
            host,
            node,
            ", ".join(map(str, away)),
            ", ".join(
                f"{w[0]} on {w[1]}" if isinstance(w, tuple) and len(w) == 2 else "?" for w in away.values()
            ),
        )
        return None, clean
    return tuple(ports[r] for r in range(len(ports))), clean


class RangeAllocator:
    """First-fit ranges of a staging buffer of ``capacity`` bytes. A range is handed out again only
    once freed or past its hold time (``math.inf``: only once freed); D holds a staged range for
    :func:`range_hold_s` of P's READ deadline, so a P that vanished does not keep D's buffer and a
    P still reading it has declined the bytes before they can change."""

    def __init__(self, capacity: int, align: int = ALIGN) -> None:
        self.capacity = int(capacity)
        self.align = max(int(align), 1)
        self._ranges: dict[int, tuple[int, int, float]] = {}  # slot -> (offset, size, expires)
        self._next = 0
        self._lock = threading.Lock()

    def alloc(self, nbytes: int, *, now: float, hold_s: float) -> tuple[int, int] | None:
        """``(slot, offset)`` of a free range of ``nbytes``, or None when none is free now."""
        if nbytes <= 0 or nbytes > self.capacity:
            return None
        size = -(-nbytes // self.align) * self.align
        with self._lock:
            self._expire(now)
            offset = 0
            for start, length, _ in sorted(self._ranges.values()):
                if start - offset >= size:
                    break  # the gap before this range fits
                offset = max(offset, start + length)
            if offset + nbytes > self.capacity:
                return None
            size = min(size, self.capacity - offset)
            self._next += 1
            self._ranges[self._next] = (offset, size, now + hold_s)
            return self._next, offset

    def free(self, slot: int) -> bool:
        with self._lock:
            return self._ranges.pop(slot, None) is not None

    def in_use(self) -> int:
        with self._lock:
            return len(self._ranges)

    def _expire(self, now: float) -> None:
        for slot in [s for s, (_, _, exp) in self._ranges.items() if exp <= now]:
            del self._ranges[slot]


# ---------------------------------------------------------------------------------- side channel
def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("staging peer closed the connection")
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket) -> object:
    return staging_decode(_recv_exact(sock, staging_frame_length(_recv_exact(sock, 4))))


_TOKEN_LABEL: Final = b"kvlease staging v1"


def staging_token(secret: str) -> str:
    """The token staging requests carry: derived from the shared control secret under its own
    label (the listener runs in the engine process and gathers KV on request, so it answers only
    holders of the secret, as the control endpoint does)."""
    return hmac.new(secret.encode("utf-8"), _TOKEN_LABEL, hashlib.sha256).hexdigest()


def ask(host: str, port: int, request: StagingRequest, timeout_s: float) -> StagingReply:
    """P's worker: one request to D's staging listener, waited for at most ``timeout_s``."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.settimeout(timeout_s)
        sock.sendall(request.to_bytes())
        return StagingReply.from_json(recv_message(sock))


def listen(
    host: str,
    port: int,
    handle: Callable[[StagingRequest], StagingReply],
    *,
    token: str,
    data_parallel_index: int,
    tp_rank: int,
) -> StagingServer:
    """D's worker: its started :class:`StagingServer` on ``port`` (:func:`staging_port`'s), or a
    :class:`~kvlease.ConfigError` naming ``kvlease.staging_port`` when it cannot listen there."""
    try:
        server = StagingServer(host, port, handle, token=token)
    except OSError as e:
        raise ConfigError(
            f"kvlease.staging_port: the staging listener of data-parallel rank {data_parallel_index}, "
            f"TP rank {tp_rank} cannot listen on {host}:{port} ({e}). Each engine takes "
            "tensor_parallel_size ports from kvlease.staging_port + data-parallel index x "
            "tensor_parallel_size; give servers on one host ranges that do not overlap, or 0 for "
            "free ports"
        ) from e
    return server.start()


class StagingServer:
    """D's worker: a thread answering staging requests one at a time, while the engine loop sleeps.

    ``handle`` gathers (or releases) and answers; it runs on this thread only, so gathers never
    overlap each other. Each connection carries one request and its reply."""

    def __init__(
        self,
        host: str,
        port: int,
        handle: Callable[[StagingRequest], StagingReply],
        io_timeout_s: float = 5.0,
        *,
        token: str,
    ) -> None:
        if not token:
            raise ValueError("a staging listener needs a token (the control secret's)")
        self._token = token
        self._handle = handle
        self._timeout = io_timeout_s
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.5)
        self.port: int = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvlease-staging", daemon=True)
        self.served = 0

    def start(self) -> StagingServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(self._timeout)
                try:
                    request = StagingRequest.from_json(recv_message(conn))
                except (ProtocolError, OSError) as e:
                    logger.warning("kvlease staging: bad request: %s", e)
                    continue
                reply = self._serve(request)
                try:
                    conn.sendall(reply.to_bytes())
                except OSError as e:
                    logger.info("kvlease staging: %s: reply not delivered (%s)", request.lease_id, e)
                self.served += 1

    def _serve(self, request: StagingRequest) -> StagingReply:
        if not hmac.compare_digest(request.auth.encode(), self._token.encode()):
            logger.warning("kvlease staging: %s request without the right token refused", request.op)
            return StagingReply(False, refusal=StagingRefusal.UNAUTHORIZED, detail="unauthorized")
        t0 = time.perf_counter()
        try:
            reply = self._handle(request)
        except Exception as e:  # a gather must never take the listener down
            logger.exception("kvlease staging: %s failed", request.lease_id)
            return StagingReply(False, refusal=StagingRefusal.ERROR, detail=f"{type(e).__name__}: {e}")
        logger.debug(
            "kvlease staging: %s %s in %.1f ms",
            request.op,
            request.lease_id,
            (time.perf_counter() - t0) * 1e3,
        )
        return reply
