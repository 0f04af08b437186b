"""Streaming readers for the analyzer's input formats, and format auto-detection.

Every reader reads the file in binary, a bounded piece at a time (``requests`` and ``turnlog``: the
whole lines of a 64 KiB chunk; other JSON lines: a line; a JSON array: a 1 MiB chunk), and feeds
:class:`~kvlease._analyze._model.Analyzer`; nothing holds the whole file.

Formats (``--format``):

``turnlog``
    The SDK turn log: JSONL, keys of :data:`kvlease.protocol.TURN_LOG_FIELDS`. ``prompt_tokens`` and
    ``completion_tokens`` may be null; ``gap_s`` (the measured idle time before the turn), when
    present, is the turn's gap; ``status`` and ``reused_tokens`` are tallied as observed outcomes.
``requests``
    Request logs, one object per line: ``{"conversation_id": "c1", "ts": 1760000000.0,
    "prompt_tokens": 18234}`` with optional ``completion_tokens``.
``vllm``
    vLLM's multi-turn benchmark (``benchmarks/multi_turn/benchmark_serving_multi_turn.py
    --stats-json-output``): a JSON array of per-request stats. Fields read: ``conversation_id``,
    ``start_time_ms`` (a monotonic clock: gaps are right, absolute times are not), ``latency_ms``
    (the turn's end is ``start + latency``), ``input_num_tokens``, ``output_num_tokens``. The same
    objects one per line are accepted too.
``mooncake``
    Mooncake traces, JSONL: ``timestamp`` (ms since the trace start), ``input_length``,
    ``output_length``, ``hash_ids`` (one id per block of ``block_size`` = 512 prompt tokens; ids are
    chained, so an equal id at position ``i`` means an equal prefix up to block ``i``). Sessions are
    inferred in file order: a request continues the session whose latest request's *full* blocks
    (all but a trailing partial block; ``input_length`` says whether the last one is full) are a
    prefix of its own ``hash_ids``, the longest such prefix winning; otherwise it starts a session.
    Only a session's latest request can be extended, so a request that forks an older prefix starts
    a new session (reuse undercounted). A session whose latest prompt's full blocks are nothing but
    a prefix shared by everyone (e.g. a first turn whose only full block is a shared system prompt)
    absorbs the next request sharing that prefix (reuse overcounted by at most that prefix).

Malformed lines are reported with their line number, skipped and counted; ``strict`` makes the
first one raise :class:`MalformedInputError`.
"""

from __future__ import annotations

import codecs
import enum
import json
import math
import re
from array import array
from collections.abc import Callable, Iterator
from itertools import repeat
from operator import itemgetter
from pathlib import Path
from typing import IO, Any, Final

from kvlease._analyze._model import TurnInput, TurnSink
from kvlease._analyze._types import InputSummary
from kvlease.protocol import BODY_CONVERSATION_ID, TURN_LOG_FIELDS, TurnLogKey
from kvlease.protocol._common import _is_number

try:  # orjson parses a short JSON line 2-3x faster; json is the fallback
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads
    JSON_BACKEND: Final = "orjson"
    _NUL_SENSITIVE = False
except ImportError:  # pragma: no cover - exercised only without the [router]/[dev] extras
    _loads = json.loads
    JSON_BACKEND = "json"  # type: ignore[misc]
    # json.loads(bytes) guesses UTF-16/32 from NUL bytes and the length: parse a line that has NUL
    # bytes with its newline, as it was read before lines were split in chunks
    _NUL_SENSITIVE = True

MOONCAKE_BLOCK_SIZE: Final = 512
MALFORMED_EXAMPLES: Final = 20
PROGRESS_STEP: Final = 1 << 22  # report progress every 4 MiB
_CHUNK: Final = 1 << 20
_LINES_CHUNK: Final = 1 << 16  # bytes of JSON lines parsed and checked at a time
_MAX_ELEMENT: Final = 64 << 20  # characters one JSON array element may span
_WS: Final = re.compile(r"[ \t\r\n]*")
_TURNLOG_ONLY: Final = frozenset(TURN_LOG_FIELDS) - {
    TurnLogKey.CONVERSATION_ID,
    TurnLogKey.TS,
    TurnLogKey.PROMPT_TOKENS,
    TurnLogKey.COMPLETION_TOKENS,
}

Progress = Callable[[int], None]


class InputFormat(str, enum.Enum):
    TURN_LOG = "turnlog"
    REQUESTS = "requests"
    VLLM = "vllm"
    MOONCAKE = "mooncake"


class AnalyzeError(Exception):
    """The input cannot be analysed (base class)."""


class FormatDetectionError(AnalyzeError):
    """The format could not be recognised from the first lines; pass it explicitly."""


class MalformedInputError(AnalyzeError):
    """A malformed record in strict mode; ``line`` is 1-based."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.message = message


class _Read:
    """What a reader saw so far: lines, records, bytes, malformed records."""

    __slots__ = ("count", "examples", "lines", "nbytes", "records", "strict", "truncated")

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.lines = self.records = self.nbytes = self.count = 0
        self.examples: list[tuple[int, str]] = []
        self.truncated: str | None = None

    def add(self, line: int, message: str) -> None:
        """One malformed record at ``line``: raise in strict mode, else count it."""
        if self.strict:
            raise MalformedInputError(line, message)
        self.count += 1
        if len(self.examples) < MALFORMED_EXAMPLES:
            self.examples.append((line, message))


# -------------------------------------------------------------------------------------------------
# detection
# -------------------------------------------------------------------------------------------------


def classify_record(obj: object) -> InputFormat | None:
    """The format one parsed record belongs to, or ``None``."""
    if not isinstance(obj, dict):
        return None
    if "hash_ids" in obj or ("input_length" in obj and "timestamp" in obj):
        return InputFormat.MOONCAKE
    if "input_num_tokens" in obj and "start_time_ms" in obj:
        return InputFormat.VLLM
    if TurnLogKey.CONVERSATION_ID in obj and TurnLogKey.TS in obj:
        return InputFormat.TURN_LOG if _TURNLOG_ONLY & obj.keys() else InputFormat.REQUESTS
    return None


def detect_format(path: str | Path, head_bytes: int = 1 << 16) -> InputFormat:
    """Guess the format from the first 64 KiB: a JSON array is vLLM's stats, else the first
    parseable JSON line decides. Empty input reads as ``requests``."""
    with open(path, "rb") as f:
        head = f.read(head_bytes)
    stripped = head.lstrip()
    if not stripped:
        return InputFormat.REQUESTS
    if stripped[:1] == b"[":
        return InputFormat.VLLM
    for raw in head.splitlines()[:200]:
        try:
            fmt = classify_record(_loads(raw))
        except ValueError:
            continue
        if fmt is not None:
            return fmt
    raise FormatDetectionError(
        f"{path}: no line in the first {head_bytes // 1024} KiB looks like a known format; "
        "pass --format turnlog|requests|vllm|mooncake"
    )


# -------------------------------------------------------------------------------------------------
# field checks (slow paths; the hot loop inlines the common case)
# -------------------------------------------------------------------------------------------------


def _count(v: object, name: str, optional: bool) -> int | None:
    """A token count: an int >= 0 (an integral float is accepted); ``None`` when optional."""
    if v is None and optional:
        return None
    if isinstance(v, float) and v.is_integer() and v >= 0:
        return int(v)
    if type(v) is int and v >= 0:
        return v
    raise ValueError(f"{name} must be an integer >= 0, got {v!r}")


def _number(v: object, name: str) -> float:
    if type(v) in (int, float) and _is_number(v):
        return float(v)
    raise ValueError(f"{name} must be a finite number, got {v!r}")


# -------------------------------------------------------------------------------------------------
# readers
# -------------------------------------------------------------------------------------------------


def _split_lines(f: IO[bytes], nbytes: list[int]) -> Iterator[tuple[list[bytes], bytes]]:
    """``(lines, newline)`` about :data:`_LINES_CHUNK` bytes at a time: whole lines without their
    newline, and ``b"\\n"``, or ``b""`` for a last line that has none. ``nbytes[0]`` counts the
    bytes read. A line longer than a chunk is joined once, not copied chunk after chunk."""
    head: list[bytes] = []  # the start of a line that has no newline yet
    while chunk := f.read(_LINES_CHUNK):
        nbytes[0] += len(chunk)
        lines = chunk.split(b"\n")
        if len(lines) == 1:
            head.append(chunk)
            continue
        if head:
            head.append(lines[0])
            lines[0] = b"".join(head)
            head.clear()
        tail = lines.pop()
        if tail:
            head.append(tail)
        yield lines, b"\n"
    if head:
        yield [b"".join(head)], b""


_get_cid: Final = itemgetter(TurnLogKey.CONVERSATION_ID)
_get_ts: Final = itemgetter(TurnLogKey.TS)
_get_prompt: Final = itemgetter(TurnLogKey.PROMPT_TOKENS)
_get_completion: Final = itemgetter(TurnLogKey.COMPLETION_TOKENS)
_NONE: Final = type(None)
_TS_TYPES: Final = frozenset((float, int))
_PROMPT_TYPES: Final = frozenset((int,))
_COMPLETION_TYPES: Final = frozenset((int, _NONE))


def _request_columns(lines: list[bytes]) -> tuple[list[Any], list[Any], list[Any], list[Any]] | None:
    """Conversation ids, timestamps, prompt and completion tokens of request lines, when every line
    is a valid request (the per-line checks of :func:`_request_lines`, on whole columns); else
    ``None``, and :func:`_request_lines` reads the lines one by one and reports the bad ones."""
    try:
        objs = list(map(_loads, lines))
        cids = list(map(_get_cid, objs))  # KeyError, or TypeError for what is not an object
        tss = list(map(_get_ts, objs))
        ps = list(map(_get_prompt, objs))
        try:
            cs = list(map(_get_completion, objs))
        except KeyError:
            cs = list(map(dict.get, objs, repeat("completion_tokens")))
        "".join(cids)  # TypeError unless every id is a string
        if not all(cids) or not _is_number(sum(tss)):  # sum: TypeError unless numbers
            return None
        # a bool passes for an int in sum() and array(): check the types (cheaper than searching
        # the lines for true and false)
        if not set(map(type, tss)) <= _TS_TYPES or set(map(type, ps)) != _PROMPT_TYPES:
            return None
        if not set(map(type, cs)) <= _COMPLETION_TYPES:
            return None
        array("Q", ps)  # TypeError or OverflowError unless every count is an int >= 0
        try:
            array("Q", cs)
        except TypeError:
            array("Q", [c for c in cs if c is not None])
    except (ValueError, KeyError, TypeError, OverflowError):
        return None
    return cids, tss, ps, cs


def _request_lines(
    lines: list[bytes], newline: bytes, first: int, rd: _Read, turnlog: bool, an: TurnSink
) -> Iterator[TurnInput]:
    """The turns of ``requests`` or ``turnlog`` lines, one line at a time; ``first`` is the number
    of the first line. Malformed lines are reported to ``rd``."""
    loads = _loads
    observe = an.observe_status
    lineno = first - 1
    for line in lines:
        lineno += 1
        try:
            if _NUL_SENSITIVE and b"\x00" in line:
                line += newline  # json detects UTF-16/32 from NUL bytes and the length: keep it exact
            obj = loads(line)
        except ValueError:
            if line.strip():
                rd.add(lineno, "not valid JSON")
            continue
        if type(obj) is not dict:
            rd.add(lineno, "not a JSON object")
            continue
        cid = obj.get(TurnLogKey.CONVERSATION_ID)
        ts = obj.get(TurnLogKey.TS)
        p = obj.get(TurnLogKey.PROMPT_TOKENS)
        c = obj.get(TurnLogKey.COMPLETION_TOKENS)
        if type(cid) is not str or not cid:
            rd.add(lineno, f"conversation_id must be a non-empty string, got {cid!r}")
            continue
        if (type(ts) is not float and type(ts) is not int) or not _is_number(ts):
            rd.add(lineno, f"ts must be a finite number of seconds, got {ts!r}")
            continue
        gap = None
        try:
            if type(p) is not int or p < 0:
                p = _count(p, "prompt_tokens", optional=turnlog)
            if c is not None and (type(c) is not int or c < 0):
                c = _count(c, "completion_tokens", optional=True)
            if turnlog:
                gap = obj.get(TurnLogKey.GAP_S)
                if gap is not None:
                    gap = _number(gap, "gap_s")
                status = obj.get(TurnLogKey.STATUS)
                reused = obj.get(TurnLogKey.REUSED_TOKENS)
                if status is not None or reused is not None:
                    observe(
                        status if isinstance(status, str) else None,
                        _count(reused, "reused_tokens", optional=True),
                    )
        except ValueError as e:
            rd.add(lineno, str(e))
            continue
        rd.records += 1
        yield cid, ts, p, c, None, gap


def _read_requests(f: IO[bytes], rd: _Read, progress: Progress | None, turnlog: bool, an: TurnSink) -> None:
    """The hot path for ``requests`` and ``turnlog``: a chunk of lines at a time, parsed and checked
    as columns when every line is a plain valid request, else line by line."""
    nbytes = [0]
    lineno = 0
    next_progress = PROGRESS_STEP if progress is not None else math.inf
    try:
        for lines, newline in _split_lines(f, nbytes):
            cols = None
            if not turnlog and not (_NUL_SENSITIVE and any(b"\x00" in line for line in lines)):
                cols = _request_columns(lines)
            if cols is not None:
                an.add_columns(*cols)
                rd.records += len(lines)
            else:
                an.add_many(_request_lines(lines, newline, lineno + 1, rd, turnlog, an))
            lineno += len(lines)
            if nbytes[0] >= next_progress:
                progress(nbytes[0])  # type: ignore[misc]
                next_progress = nbytes[0] + PROGRESS_STEP
    finally:
        rd.lines, rd.nbytes = lineno, nbytes[0]


Converter = Callable[[object], TurnInput]  # raises ValueError with a message for a malformed record


def _vllm_record(obj: object) -> TurnInput:
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    cid = obj.get(BODY_CONVERSATION_ID)  # vLLM's benchmark spells it as its multi-turn proxy does
    if isinstance(cid, int) and not isinstance(cid, bool):
        cid = str(cid)
    if not isinstance(cid, str) or not cid:
        raise ValueError(f"conversation_id must be a non-empty string, got {cid!r}")
    ts = _number(obj.get("start_time_ms"), "start_time_ms") / 1000.0
    lat = obj.get("latency_ms")
    end = None
    if lat is not None:
        lat = _number(lat, "latency_ms")
        end = ts + lat / 1000.0 if lat >= 0 else None  # the benchmark writes -1 when unknown
    p = _count(obj.get("input_num_tokens"), "input_num_tokens", optional=False)
    c = _count(obj.get("output_num_tokens"), "output_num_tokens", optional=True)
    return cid, ts, p, c, end, None


class MooncakeSessions:
    """Infers sessions from chained ``hash_ids`` (the rule is in the module docstring). Sans-IO;
    memory: two dict entries per session."""

    def __init__(self, block_size: int = MOONCAKE_BLOCK_SIZE) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self._index: dict[int, tuple[int, int]] = {}  # key block id -> (session, position)
        self._key: dict[int, int] = {}  # session -> its key block id
        self.sessions = 0

    def full_blocks(self, n_ids: int, input_length: int) -> int:
        """Blocks of a prompt that are full (the last one is partial unless the length says not)."""
        if n_ids == -(-input_length // self.block_size):
            return input_length // self.block_size
        return max(n_ids - 1, 0)  # lengths disagree with the block size: assume a partial last block

    def assign(self, hash_ids: list[int], input_length: int) -> int:
        """The session number of the next request."""
        index = self._index
        session = -1
        for i in range(len(hash_ids) - 1, -1, -1):
            hit = index.get(hash_ids[i])
            if hit is not None and hit[1] == i:
                session = hit[0]
                del index[self._key.pop(session)]
                break
        if session < 0:
            session = self.sessions
            self.sessions += 1
        n_full = self.full_blocks(len(hash_ids), input_length)
        if n_full:
            key = hash_ids[n_full - 1]
            other = index.get(key)
            if other is not None:  # only with ids that are not chained: the newest session wins
                del self._key[other[0]]
            index[key] = (session, n_full - 1)
            self._key[session] = key
        return session


def _mooncake_converter(block_size: int) -> Converter:
    sessions = MooncakeSessions(block_size)

    def convert(obj: object) -> TurnInput:
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        ts = _number(obj.get("timestamp"), "timestamp") / 1000.0
        p = _count(obj.get("input_length"), "input_length", optional=False)
        c = _count(obj.get("output_length"), "output_length", optional=True)
        ids = obj.get("hash_ids")
        if not isinstance(ids, list) or not all(type(h) is int for h in ids):
            raise ValueError("hash_ids must be a list of integers")
        assert p is not None
        return f"session-{sessions.assign(ids, p)}", ts, p, c, None, None

    return convert


def _iter_jsonl(
    f: IO[bytes], convert: Converter, rd: _Read, progress: Progress | None
) -> Iterator[TurnInput]:
    lineno = records = nbytes = 0
    next_progress = PROGRESS_STEP if progress is not None else math.inf
    try:
        for line in f:
            lineno += 1
            nbytes += len(line)
            if nbytes >= next_progress:
                progress(nbytes)  # type: ignore[misc]
                next_progress = nbytes + PROGRESS_STEP
            try:
                obj = _loads(line)
            except ValueError:
                if line.strip():
                    rd.add(lineno, "not valid JSON")
                continue
            try:
                turn = convert(obj)
            except ValueError as e:
                rd.add(lineno, str(e))
                continue
            records += 1
            yield turn
    finally:
        rd.lines, rd.records, rd.nbytes = lineno, records, nbytes


def iter_json_array(
    f: IO[bytes], rd: _Read, progress: Progress | None = None
) -> Iterator[tuple[int, object]]:
    """Yield ``(line, element)`` of a top-level JSON array, reading 1 MiB at a time. A syntax error
    ends the scan (recorded as one malformed record and in ``rd.truncated``)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    dec = json.JSONDecoder()
    buf, pos, line, eof = "", 0, 1, False
    state = "start"  # start -> value_or_end -> sep -> value -> sep ... -> done
    next_progress = PROGRESS_STEP

    def refill() -> None:
        nonlocal buf, pos, eof, next_progress
        chunk = f.read(_CHUNK)
        rd.nbytes += len(chunk)
        if progress is not None and rd.nbytes >= next_progress:
            progress(rd.nbytes)
            next_progress = rd.nbytes + PROGRESS_STEP
        eof = not chunk
        buf = buf[pos:] + decoder.decode(chunk, final=eof)
        pos = 0

    try:
        while True:
            end_ws = _WS.match(buf, pos).end()  # type: ignore[union-attr]
            line += buf.count("\n", pos, end_ws)
            pos = end_ws
            if pos >= len(buf):
                if eof:
                    if state != "done":
                        rd.truncated = f"line {line}: the JSON array is not closed"
                        rd.add(line, "unexpected end of file inside the JSON array")
                    return
                refill()
                continue
            ch = buf[pos]
            if state == "done":
                rd.add(line, "text after the end of the JSON array")
                return
            if state == "start":
                if ch != "[":
                    rd.truncated = f"line {line}: expected a JSON array"
                    rd.add(line, "expected '[' (a JSON array of per-request stats)")
                    return
                pos += 1
                state = "value_or_end"
                continue
            if ch == "]" and state in ("sep", "value_or_end"):
                pos += 1
                state = "done"
                continue
            if state == "sep":
                if ch != ",":
                    rd.truncated = f"line {line}: expected ',' or ']'"
                    rd.add(line, "expected ',' or ']' between array elements")
                    return
                pos += 1
                state = "value"
                continue
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if not eof and len(buf) - pos < _MAX_ELEMENT:
                    refill()
                    continue
                err_line = line + buf.count("\n", pos, e.pos)
                rd.truncated = f"line {err_line}: {e.msg}; the rest of the array was not read"
                rd.add(err_line, f"invalid JSON ({e.msg})")
                return
            if end >= len(buf) and not eof and not isinstance(obj, (dict, list)):
                refill()  # a bare number may continue in the next chunk
                continue
            yield line, obj
            line += buf.count("\n", pos, end)
            pos = end
            state = "sep"
    finally:
        rd.lines = line


def _iter_array(
    f: IO[bytes], convert: Converter, rd: _Read, progress: Progress | None
) -> Iterator[TurnInput]:
    for line, obj in iter_json_array(f, rd, progress):
        try:
            turn = convert(obj)
        except ValueError as e:
            rd.add(line, str(e))
            continue
        rd.records += 1
        yield turn


def _starts_array(path: str | Path) -> bool:
    with open(path, "rb") as f:
        return f.read(_CHUNK).lstrip()[:1] == b"["


def read_into(
    an: TurnSink,
    path: str | Path,
    fmt: InputFormat | None = None,
    *,
    strict: bool = False,
    progress: Progress | None = None,
    mooncake_block_size: int = MOONCAKE_BLOCK_SIZE,
) -> InputSummary:
    """Stream ``path`` into ``an``; return what was read. Raises :class:`FormatDetectionError`, and
    :class:`MalformedInputError` in strict mode."""
    fmt = detect_format(path) if fmt is None else InputFormat(fmt)
    rd = _Read(strict)
    with open(path, "rb", buffering=_CHUNK) as f:
        if fmt in (InputFormat.REQUESTS, InputFormat.TURN_LOG):
            _read_requests(f, rd, progress, fmt is InputFormat.TURN_LOG, an)
        elif fmt is InputFormat.VLLM and _starts_array(path):
            an.add_many(_iter_array(f, _vllm_record, rd, progress))
        else:
            convert = _vllm_record if fmt is InputFormat.VLLM else _mooncake_converter(mooncake_block_size)
            an.add_many(_iter_jsonl(f, convert, rd, progress))
    if progress is not None:
        progress(rd.nbytes)
    return InputSummary(
        format=fmt.value,
        source=str(path),
        bytes_read=rd.nbytes,
        lines=rd.lines,
        records=rd.records,
        malformed=rd.count,
        malformed_examples=tuple(rd.examples),
        truncated=rd.truncated,
    )
