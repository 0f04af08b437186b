"""The ``requests``/``turnlog`` reader reads chunks of lines and checks them as columns: it must
report exactly what reading the file line by line reports (lines, records, malformed lines and
their numbers, every figure), wherever the chunk boundaries fall, with orjson or json."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlease._analyze import MalformedInputError, analyze
from kvlease._analyze import _formats as F
from kvlease._analyze._model import Analyzer
from kvlease._analyze._types import InputSummary


def line_by_line(path: Path, turnlog: bool = False) -> dict[str, Any]:
    """The reference: the file's own line iteration, each line through the per-line checks."""
    rd = F._Read(strict=False)
    an = Analyzer()
    lineno = nbytes = 0
    with open(path, "rb") as f:
        for raw in f:
            lineno += 1
            nbytes += len(raw)
            # the line as read, newline included (what the reader parsed before it read chunks)
            an.add_many(F._request_lines([raw], b"", lineno, rd, turnlog, an))
    summary = InputSummary(
        format="turnlog" if turnlog else "requests",
        source=str(path),
        bytes_read=nbytes,
        lines=lineno,
        records=rd.records,
        malformed=rd.count,
        malformed_examples=tuple(rd.examples),
    )
    return an.report(summary).to_json()


def good(cid: str = "a", ts: Any = 1.5, p: Any = 10, c: Any = 3) -> str:
    return json.dumps({"conversation_id": cid, "ts": ts, "prompt_tokens": p, "completion_tokens": c})


_LINES = st.one_of(
    st.builds(
        good,
        st.sampled_from(["a", "b", "conv-é", "true", ""]),
        st.one_of(st.floats(0, 5000, allow_nan=False).map(lambda x: round(x, 2)), st.integers(0, 5000)),
        st.one_of(st.integers(0, 9000), st.sampled_from([True, False, 2.0, 2.5, -1, None, "7"])),
        st.one_of(st.integers(0, 900), st.sampled_from([None, True, 1.0, -3])),
    ),
    st.sampled_from(
        [
            "",
            "   ",
            "\r",
            "not json",
            "[1, 2]",
            "42",
            "null",
            '{"conversation_id": "a", "ts": 2}',
            '{"conversation_id": "a", "ts": 2, "prompt_tokens": 5}',
            '{"conversation_id": "b", "ts": 1e999, "prompt_tokens": 5}',
            '{"conversation_id": "b", "ts": "x", "prompt_tokens": 5}',
            '{"conversation_id": 7, "ts": 3, "prompt_tokens": 5}',
            '{"conversation_id": "a", "ts": 4, "prompt_tokens": 5, "x": [true, {"y": false}]}',
            '{"ts": 5, "prompt_tokens": 6, "conversation_id": "c"}',
            '{"conversation_id": "a", "ts": 6, "prompt_tokens": 5',
            '{"conversation_id": "a\\u0000", "ts": 7, "prompt_tokens": 5}',
            '{"conversation_id": "a", "ts": 8, "prompt_tokens": 5}\x00',
            '\x00{"conversation_id": "a", "ts": 8, "prompt_tokens": 5}',
            "1\x00",  # json reads UTF-16 from NUL bytes and the length: with the newline, not JSON
            "{\x00}\x00",
        ]
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(_LINES, max_size=60),
    crlf=st.booleans(),
    last_newline=st.booleans(),
    chunk=st.sampled_from([1, 2, 7, 64, 1000, 1 << 16]),
    backend=st.sampled_from(["orjson", "json"]),
    turnlog=st.booleans(),
)
def test_chunks_read_like_lines(
    tmp_path: Path,
    lines: list[str],
    crlf: bool,
    last_newline: bool,
    chunk: int,
    backend: str,
    turnlog: bool,
) -> None:
    nl = "\r\n" if crlf else "\n"
    text = nl.join(lines) + (nl if last_newline and lines else "")
    path = tmp_path / "r.jsonl"
    path.write_bytes(text.encode())
    loads = F._loads if backend == "orjson" else json.loads
    with (
        mock.patch.object(F, "_LINES_CHUNK", chunk),
        mock.patch.object(F, "_loads", loads),
        mock.patch.object(F, "_NUL_SENSITIVE", backend == "json"),
    ):
        want = line_by_line(path, turnlog)
        got = analyze(path, format="turnlog" if turnlog else "requests").to_json()
    assert got == want
    assert got["input"]["bytes_read"] == len(text.encode())


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "r.jsonl"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("chunk", [1, 5, 50, 1 << 16])
def test_boundaries_crlf_and_a_last_line_without_newline(tmp_path: Path, chunk: int) -> None:
    rows = [good("a", 0, 100, 10), good("a", 60, 150, 5), "", good("b", 0, 10), "oops", good("a", 900, 200)]
    path = _write(tmp_path, "\r\n".join(rows).encode())  # no newline after the last line
    with mock.patch.object(F, "_LINES_CHUNK", chunk):
        r = analyze(path)
    assert (r.input.lines, r.input.records, r.input.malformed) == (6, 4, 1)
    assert r.input.malformed_examples == ((5, "not valid JSON"),)
    assert r.input.bytes_read == path.stat().st_size
    assert (r.conversations, r.follow_up_turns, r.prompt_tokens) == (2, 2, 350)
    assert r.repeated_tokens_estimate == 110 + 155


def test_a_line_longer_than_many_chunks(tmp_path: Path) -> None:
    long = json.dumps({"conversation_id": "a", "ts": 1, "prompt_tokens": 5, "pad": "x" * 5000})
    path = _write(tmp_path, f"{long}\n{good('a', 2, 7)}\n{long}".encode())
    with mock.patch.object(F, "_LINES_CHUNK", 64):
        r = analyze(path)
    assert (r.input.lines, r.input.records, r.input.malformed, r.follow_up_turns) == (3, 3, 0, 2)
    assert r.repeated_tokens_lower_bound == 5 + 5  # sorted: 5 (ts 1), 5 (ts 1), 7 (ts 2)


def test_split_lines_joins_a_long_line_once() -> None:
    class Reads:
        def __init__(self, parts: list[bytes]) -> None:
            self.parts = parts

        def read(self, n: int) -> bytes:
            return self.parts.pop(0) if self.parts else b""

    nbytes = [0]
    got: Iterator[tuple[list[bytes], bytes]] = F._split_lines(
        Reads([b"ab", b"cd", b"e\nf", b"g\n", b"\n", b"h"]),  # type: ignore[arg-type]
        nbytes,
    )
    assert list(got) == [([b"abcde"], b"\n"), ([b"fg"], b"\n"), ([b""], b"\n"), ([b"h"], b"")]
    assert nbytes == [11]


@pytest.mark.parametrize("chunk", [3, 1 << 16])
def test_strict_stops_at_the_first_bad_line_in_any_chunk(tmp_path: Path, chunk: int) -> None:
    rows = [good("a", t, 10) for t in range(20)]
    rows[13] = good("a", 13, True)
    path = _write(tmp_path, ("\n".join(rows) + "\n").encode())
    with mock.patch.object(F, "_LINES_CHUNK", chunk), pytest.raises(MalformedInputError) as e:
        analyze(path, strict=True)
    assert e.value.line == 14 and "prompt_tokens" in e.value.message


def test_progress_is_monotonic_and_ends_at_the_size(tmp_path: Path) -> None:
    path = _write(tmp_path, "".join(good("a", t, 10) + "\n" for t in range(3000)).encode())
    seen: list[int] = []
    with mock.patch.object(F, "_LINES_CHUNK", 1000), mock.patch.object(F, "PROGRESS_STEP", 10_000):
        analyze(path, progress=seen.append)
    assert len(seen) > 5 and seen == sorted(seen) and seen[-1] == path.stat().st_size


@pytest.mark.parametrize(
    ("value", "column"),
    [
        (True, "ts"),
        (False, "ts"),
        (True, "prompt_tokens"),
        (False, "completion_tokens"),
        ("1", "completion_tokens"),
        (2.0, "prompt_tokens"),
        (None, "prompt_tokens"),
        (-1, "completion_tokens"),
        (1.5, "completion_tokens"),
    ],
)
def test_one_bad_value_sends_the_chunk_line_by_line(tmp_path: Path, value: Any, column: str) -> None:
    rows = [json.loads(good("a", t, 10 + t, 1)) for t in range(50)]
    rows[20][column] = value
    path = _write(tmp_path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    assert analyze(path).to_json() == line_by_line(path)
