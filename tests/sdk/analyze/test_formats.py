"""Readers and detection on the committed samples (figures computed by hand) and on bad input."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvlease._analyze import (
    FormatDetectionError,
    InputFormat,
    MalformedInputError,
    MooncakeSessions,
    analyze,
    detect_format,
)
from kvlease._analyze._formats import _Read, iter_json_array

DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("requests_small.jsonl", InputFormat.REQUESTS),
        ("turnlog_small.jsonl", InputFormat.TURN_LOG),
        ("vllm_multiturn_stats.json", InputFormat.VLLM),
        ("mooncake_small.jsonl", InputFormat.MOONCAKE),
        ("agents.jsonl", InputFormat.REQUESTS),
        ("empty.jsonl", InputFormat.REQUESTS),
    ],
)
def test_detection(name: str, fmt: InputFormat) -> None:
    assert detect_format(DATA / name) is fmt


def test_detection_fails_clearly(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    p.write_text('{"foo": 1}\nnot json\n')
    with pytest.raises(FormatDetectionError, match="--format"):
        detect_format(p)


def test_requests_sample_hand_computed() -> None:
    """See scripts/make_samples.py: a (unsorted), b (duplicate ts, zero prompt), c (one turn), d (zeros)."""
    r = analyze(DATA / "requests_small.jsonl")
    assert (r.input.lines, r.input.records, r.input.malformed) == (11, 9, 2)
    assert [n for n, _ in r.input.malformed_examples] == [4, 8]
    assert (r.conversations, r.turns, r.follow_up_turns, r.one_turn_conversations) == (4, 9, 5, 1)
    assert r.max_turns_in_conversation == 3
    # a: 1000(100,+20) 1010(150,+30) 1600(200); b: 2000(0) 2000(50) 4000(60); d: 3000(0) 3100(0)
    assert r.prompt_tokens == 150 + 200 + 50 + 60 + 0
    assert r.repeated_tokens_lower_bound == 100 + 150 + 0 + 50 + 0
    assert r.repeated_tokens_estimate == 120 + 180 + 0 + 50 + 0
    assert r.repeated_share_lower_bound == pytest.approx(300 / 460)
    assert r.repeated_share_estimate == pytest.approx(350 / 460)
    # gaps 10, 590, 0, 2000, 100
    assert (r.turns_within_ttl, r.turns_beyond_ttl, r.turns_recovered_by_leases, r.turns_beyond_max_idle) == (
        3,
        2,
        1,
        1,
    )
    assert r.gap_p50_s == 100.0
    assert r.gap_p90_s == pytest.approx(1436.0)
    assert r.gap_p99_s == pytest.approx(1943.6)
    assert r.span_s == 3000.0
    assert r.saved_tokens_leases == 300 and r.saved_tokens_fixed_ttl == 120
    assert r.saved_tokens_per_hour_leases == pytest.approx(360.0)
    assert r.saved_tokens_per_hour_fixed_ttl == pytest.approx(144.0)
    by = {t.index: t for t in r.per_turn_index}
    assert (by[2].turns, by[2].prompt_tokens, by[2].repeated_estimate) == (3, 200, pytest.approx(120 / 200))
    assert (by[3].turns, by[3].prompt_tokens, by[3].repeated_lower_bound) == (
        2,
        260,
        pytest.approx(200 / 260),
    )


def test_requests_strict_stops_at_first_bad_line() -> None:
    with pytest.raises(MalformedInputError) as e:
        analyze(DATA / "requests_small.jsonl", strict=True)
    assert e.value.line == 4 and "line 4" in str(e.value)


def test_turnlog_sample_uses_gap_s_and_tallies_statuses() -> None:
    r = analyze(DATA / "turnlog_small.jsonl")
    assert r.input.format == "turnlog" and r.input.malformed == 0
    assert (r.conversations, r.follow_up_turns) == (2, 3)
    # t1: 1000(+200) -> 1300(+100) -> 1500: lower 1000 + 1300, estimate min(1200,1300) + min(1400,1500)
    # t2: second turn has no prompt size: gap only
    assert r.token_turns == 2
    assert r.repeated_tokens_lower_bound == 2300 and r.repeated_tokens_estimate == 2600
    # gaps from gap_s: 25, 660, 5 (not the ts differences 30, 670, 10)
    assert r.gap_p50_s == 25.0 and r.turns_beyond_ttl == 1 and r.turns_recovered_by_leases == 1
    assert r.statuses == {"first": 2, "hit": 1, "expired": 1, "error": 1}
    assert r.reused_tokens_observed == 1184


def test_vllm_stats_sample() -> None:
    r = analyze(DATA / "vllm_multiturn_stats.json")
    assert r.input.format == "vllm" and r.input.records == 4 and r.input.malformed == 1
    (line, message), *_ = r.input.malformed_examples
    assert line == 44 and "input_num_tokens" in message
    # CONV_ID_0: 1.0-1.5 s (100, +20), 3.0-3.4 s (150, +10), 603.4 s (170); gaps from the end: 1.5, 600
    assert r.follow_up_turns == 2
    assert r.repeated_tokens_lower_bound == 100 + 150
    assert r.repeated_tokens_estimate == 120 + 160
    assert r.gap_p50_s == pytest.approx(300.75)
    assert (r.turns_beyond_ttl, r.turns_recovered_by_leases) == (1, 1)


class Trickle(io.RawIOBase):
    """A file that returns at most ``n`` bytes per read: every chunk boundary gets exercised."""

    def __init__(self, data: bytes, n: int) -> None:
        self._data, self._pos, self._n = data, 0, n

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        chunk = self._data[self._pos : self._pos + min(self._n, len(b))]
        b[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


@pytest.mark.parametrize("n", [1, 3, 7, 64, 1 << 20])
def test_json_array_reader_across_chunk_boundaries(n: int) -> None:
    items = [{"a": i, "s": "x{}\n,]" * i, "n": 12345.5 + i} for i in range(6)] + [42, "é"]
    data = json.dumps(items, indent=2, ensure_ascii=False).encode()
    rd = _Read(strict=False)
    got = list(iter_json_array(Trickle(data, n), rd))  # type: ignore[arg-type]
    assert [obj for _, obj in got] == items
    assert got[0][0] == 2  # the first element starts on line 2 (indent=2)
    assert rd.count == 0 and rd.truncated is None


@pytest.mark.parametrize(
    ("data", "line", "what"),
    [
        (b'[\n{"a": 1},\n', 3, "not closed"),
        (b'[\n{"a": 1},\n{"a": 2\n', 4, "rest of the array"),  # the decoder stops at the end
        (b'[\n{"a": 1}\n{"a": 2}]', 3, "expected ','"),
        (b'[\n{"a": 1},\n{"a": nope}\n]', 3, "rest of the array"),
        (b'{"a": 1}', 1, "expected a JSON array"),
    ],
)
def test_json_array_reader_reports_broken_arrays(data: bytes, line: int, what: str) -> None:
    rd = _Read(strict=False)
    got = list(iter_json_array(Trickle(data, 5), rd))  # type: ignore[arg-type]
    assert rd.count == 1 and rd.examples[0][0] == line
    assert rd.truncated is not None and what in rd.truncated
    assert len(got) <= 1


def test_mooncake_sample_sessions() -> None:
    r = analyze(DATA / "mooncake_small.jsonl")
    assert r.input.format == "mooncake" and r.conversations == 2 and r.follow_up_turns == 2
    # session 0: 1100 (+50) -> 1700 (+30) -> 2300 at 0 s, 5 s, 600 s
    assert r.repeated_tokens_lower_bound == 1100 + 1700
    assert r.repeated_tokens_estimate == 1150 + 1730
    assert (r.turns_within_ttl, r.turns_recovered_by_leases) == (1, 1)


@pytest.mark.parametrize(
    ("requests", "sessions"),
    [
        # continuation through the last full block; the partial last block (2) never matches
        ([([0, 1, 2], 1100), ([0, 1, 4, 5], 1700), ([0, 1, 4, 9], 1900)], [0, 0, 0]),
        # shared first block only when the previous request has more full blocks: new session
        ([([0, 1, 2], 1100), ([0, 3, 4], 1100)], [0, 1]),
        # a fork from an older prefix starts a new session
        ([([0, 1, 2], 1100), ([0, 1, 4, 5], 1700), ([0, 1, 6], 1100)], [0, 0, 1]),
        # exact multiple of the block size: every block is full
        ([([10, 11], 1024), ([10, 11, 12], 1300)], [0, 0]),
        # lengths that disagree with the block size: the last id is taken as partial
        ([([20, 21, 22], 100), ([20, 21, 23], 100)], [0, 0]),
        # the longest prefix wins
        ([([0, 5, 6], 1100), ([0, 7], 600), ([0, 5, 6, 8], 1600)], [0, 1, 0]),
        # the documented over-absorption: a latest prompt whose only full block is shared
        ([([0, 1], 600), ([0, 5, 6, 7], 1600)], [0, 0]),
    ],
)
def test_mooncake_session_rule(requests: list[tuple[list[int], int]], sessions: list[int]) -> None:
    m = MooncakeSessions()
    assert [m.assign(ids, n) for ids, n in requests] == sessions


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1, 2]", "not a JSON object"),
        ('{"conversation_id": 5, "ts": 1, "prompt_tokens": 1}', "conversation_id"),
        ('{"conversation_id": "a", "ts": "now", "prompt_tokens": 1}', "ts"),
        ('{"conversation_id": "a", "ts": NaN, "prompt_tokens": 1}', "not valid JSON"),
        ('{"conversation_id": "a", "ts": 1, "prompt_tokens": -1}', "prompt_tokens"),
        ('{"conversation_id": "a", "ts": 1, "prompt_tokens": true}', "prompt_tokens"),
        ('{"conversation_id": "a", "ts": 1}', "prompt_tokens"),
        (
            '{"conversation_id": "a", "ts": 1, "prompt_tokens": 1, "completion_tokens": 1.5}',
            "completion_tokens",
        ),
        ('{"conversation_id": "a", "ts": 1, "prompt_tokens": 3', "not valid JSON"),
        # an integer too large for a float: a malformed line, not a crash
        ('{"conversation_id": "a", "ts": 1' + "0" * 400 + ', "prompt_tokens": 1}', "not valid JSON"),
    ],
)
def test_malformed_request_lines(tmp_path: Path, line: str, message: str) -> None:
    p = tmp_path / "r.jsonl"
    good = '{"conversation_id": "a", "ts": 0, "prompt_tokens": 10}'
    p.write_text(f"{good}\n\n{line}\n{good}\n")
    r = analyze(p, format="requests")
    assert (r.input.lines, r.input.records, r.input.malformed) == (4, 2, 1)
    assert r.input.malformed_examples[0][0] == 3 and message in r.input.malformed_examples[0][1]
    with pytest.raises(MalformedInputError, match="line 3"):
        analyze(p, format="requests", strict=True)


def test_integral_float_token_counts_are_accepted(tmp_path: Path) -> None:
    p = tmp_path / "r.jsonl"
    p.write_text(
        '{"conversation_id": "a", "ts": 0, "prompt_tokens": 10.0}\n{"conversation_id": "a", "ts": 1, "prompt_tokens": 20}\n'
    )
    assert analyze(p).repeated_tokens_lower_bound == 10


def test_progress_reports_bytes(tmp_path: Path) -> None:
    seen: list[int] = []
    r = analyze(DATA / "agents.jsonl", progress=seen.append)
    assert seen and seen[-1] == r.input.bytes_read == (DATA / "agents.jsonl").stat().st_size


def test_reads_the_turn_log_the_sdk_writes(tmp_path: Path) -> None:
    from kvlease._core import Turn
    from kvlease._strip import HistoryClass
    from kvlease._turnlog import TurnLog
    from kvlease.protocol import ReuseStatus

    def turn(i: int, start: float, end: float, prompt: int, completion: int, gap: float | None) -> Turn:
        return Turn(
            index=i,
            conversation_id="conv-1",
            started_at=start,
            ended_at=end,
            ttft_s=0.1,
            prompt_tokens=prompt,
            completion_tokens=completion,
            status=ReuseStatus.FIRST if i == 1 else ReuseStatus.HIT,
            reused_tokens=0 if i == 1 else prompt - 50,
            ttl_s=480.0,
            history=HistoryClass.FIRST_TURN if i == 1 else HistoryClass.EXACT,
            reuse_forced_off=False,
            gap_s=gap,
        )

    path = tmp_path / "turns.jsonl"
    with TurnLog(path) as log:
        log.write(turn(1, 1000.0, 1002.0, 500, 100, None))
        log.write(turn(2, 1062.0, 1063.0, 650, 40, 60.0))
        log.write(turn(3, 1663.0, 1664.0, 700, 10, 600.0))
    assert detect_format(path) is InputFormat.TURN_LOG
    r = analyze(path)
    assert r.input.malformed == 0 and r.follow_up_turns == 2
    assert r.repeated_tokens_lower_bound == 500 + 650
    assert r.repeated_tokens_estimate == 600 + 690
    assert (r.turns_within_ttl, r.turns_recovered_by_leases) == (1, 1)
    assert r.statuses == {"first": 1, "hit": 2} and r.reused_tokens_observed == 600 + 650
