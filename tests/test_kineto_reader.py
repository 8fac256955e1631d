"""Streaming Kineto reader: every sample trace, odd layouts, and damaged input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from conftest import SHARED_DATA, require
from kineto_helpers import cpu, kernel, load_json, write_trace

from triscope.collectors.kineto.reader import TraceHeader, read_all, read_trace
from triscope.errors import InputError

SAMPLES = sorted(p for p in (SHARED_DATA / "kineto").glob("*.json*")) if (SHARED_DATA / "kineto").exists() else []


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
@pytest.mark.parametrize("block_bytes", [4096, 8 << 20])
def test_every_sample_trace_reads_like_the_stdlib(path: Path, block_bytes: int):
    doc = load_json(path, exact=True)
    header = TraceHeader()
    events = [e for block in read_trace(path, header, block_bytes=block_bytes) for e in block]
    assert len(events) == len(doc["traceEvents"])
    for ours, theirs in zip(events, doc["traceEvents"], strict=True):
        assert ours.name == theirs.get("name", "")
        assert ours.ph == theirs.get("ph", "")
        assert ours.ts == theirs.get("ts", 0)  # exact: both Decimal
    assert header.metadata == {k: v for k, v in load_json(path).items() if k != "traceEvents"}


def test_samples_are_present():
    require(bool(SAMPLES), "../shared/data/kineto is absent")
    assert len(SAMPLES) >= 10


def _tricky_events(n: int = 300) -> list[dict]:
    events = []
    for i in range(n):
        # Names containing the block separator, braces and escaped quotes must not confuse the cutter.
        events.append(kernel(f'k{i} }}, {{ "x": [1], \\"q\\"', ts=1000.0 + i, dur=0.5, correlation=i))
        events.append(cpu("op", ts=1000.0 + i, dur=0.25, **{"Input Dims": [[1, 2], [3]], "nested": {"a": [{"b": 1}]}}))
    return events


@pytest.mark.parametrize("compact", [False, True], ids=["indented", "compact"])
def test_adversarial_layouts_decode_exactly(tmp_path: Path, compact: bool):
    events = _tricky_events()
    path = write_trace(tmp_path / "t.json", events, compact=compact, baseTimeNanoseconds=5)
    for block_bytes in (512, 4096, 1 << 20):
        header, got = read_all_blocks(path, block_bytes)
        assert [e.name for e in got] == [e["name"] for e in events]
        assert header.base_time_ns == 5


def read_all_blocks(path: Path, block_bytes: int):
    header = TraceHeader()
    return header, [e for block in read_trace(path, header, block_bytes=block_bytes) for e in block]


def test_metadata_after_the_events_is_read(tmp_path: Path):
    path = tmp_path / "late.json"
    events = [kernel("a", 1.0, 1.0)]
    path.write_text(json.dumps({"traceEvents": events, "deviceProperties": [{"id": 0}], "INFO": ["x]"],
                                "distributedInfo": {"rank": 3}, "baseTimeNanoseconds": 1700000000000000000}))
    header, got = read_all(path)
    assert len(got) == 1
    assert header.rank == 3 and header.base_time_ns == 1700000000000000000
    assert header.metadata["deviceProperties"] == [{"id": 0}]


def test_truncated_plain_trace_keeps_complete_events(tmp_path: Path):
    events = [kernel(f"k{i}", float(i), 1.0) for i in range(200)]
    full = write_trace(tmp_path / "full.json", events).read_bytes()
    cut = tmp_path / "cut.json"
    cut.write_bytes(full[: int(len(full) * 0.6)])
    got = []
    with pytest.raises(InputError) as info:
        for block in read_trace(cut):
            got.extend(block)
    assert "truncated or corrupt" in str(info.value) and "\n" not in str(info.value)
    assert 100 <= len(got) < 200
    assert [e.name for e in got] == [f"k{i}" for i in range(len(got))]


def test_truncated_gzip_keeps_complete_events(tmp_path: Path):
    events = [kernel(f"k{i}", float(i), 1.0) for i in range(5000)]
    data = gzip.compress(json.dumps({"traceEvents": events}, indent=2).encode())
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(data[: len(data) // 2])
    got = []
    with pytest.raises(InputError, match="cut short|truncated"):
        for block in read_trace(cut, block_bytes=16384):
            got.extend(block)
    assert got and [e.name for e in got] == [f"k{i}" for i in range(len(got))]


@pytest.mark.parametrize("payload, message", [
    (b"\x1f\x8b\x08\x00garbage-not-deflate" * 4, "corrupt or cut short"),
    (b"", "empty file"),
    (b'{"schemaVersion": 1, "other": []}', "no traceEvents array"),
    (b'{"traceEvents": [{"ph": "X", "name": "a"}, {"ph": "X", "name": tru}]}', "corrupt JSON|truncated or corrupt"),
    (b'{"traceEvents": [{"ph": "X", "ts": "soon"}]}', "invalid event|truncated or corrupt"),
])
def test_damaged_input_fails_with_one_line(tmp_path: Path, payload: bytes, message: str):
    path = tmp_path / "bad.json"
    path.write_bytes(payload)
    with pytest.raises(InputError, match=message) as info:
        read_all(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_missing_file_is_an_input_error(tmp_path: Path):
    with pytest.raises(InputError, match="cannot open"):
        read_all(tmp_path / "nope.json")


@pytest.mark.parametrize("truncate", [False, True], ids=["whole", "truncated"])
def test_pipelined_sink_steps_back_over_refused_blocks(tmp_path: Path, truncate: bool):
    """``raw_submit`` (one block in flight in another thread): refused blocks are decoded by the
    reader, accepted ones are not, and every event comes out exactly once."""
    from concurrent.futures import ThreadPoolExecutor

    events = _tricky_events(400)
    path = write_trace(tmp_path / "t.json", events, compact=True)
    if truncate:
        path.write_bytes(path.read_bytes()[: int(path.stat().st_size * 0.7)])
    accepted: list[tuple[int, list[str]]] = []
    offers = 0

    def sink(events: bytes, k: int) -> bytes | None:
        if k % 3 == 1:  # refuse every third block, including good ones
            return events
        try:
            accepted.append((k, [e["name"] for e in json.loads(b"[" + events + b"]")]))
        except json.JSONDecodeError:
            return events  # a cut inside a string: refuse like ClickHouse does
        return None

    stream: list[tuple[str, list[str]]] = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        def submit(buf: bytes, end: int):
            nonlocal offers
            offers += 1
            return pool.submit(sink, bytes(buf[:end]), offers)  # the sink keeps its own copy

        try:
            for block in read_trace(path, block_bytes=2048, raw_submit=submit):
                stream.append(("decoded", [e.name for e in block]))
        except InputError as exc:
            assert truncate and "truncated" in str(exc)
        else:
            assert not truncate
    got = [n for _, names in accepted for n in names] + [n for _, names in stream for n in names]
    kernels = [e["name"] for e in events if e["cat"] == "kernel"]
    names = sorted((n for n in got if n != "op"), key=lambda n: int(n.split()[0][1:]))
    assert len(names) == len(set(names)), "no event twice"
    assert names == kernels[: len(names)] and (truncate or names == kernels)
    if not truncate:
        assert got.count("op") == len(events) - len(kernels)
    assert accepted and any(kind == "decoded" for kind, _ in stream), "both paths were used"


def test_a_list_valued_key_after_trace_events_is_not_taken_for_its_end(tmp_path: Path):
    """``{"traceEvents": [...], "deviceProperties": [{...}]}``: the "]" closing deviceProperties
    also leaves a parseable document; the reader must offer the real events array first."""
    events = [kernel(f"k{i}", ts=float(i), dur=1.0) for i in range(50)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events,
                                "deviceProperties": [{"id": 0, "name": "H100"}], "traceName": "x"}))
    offered: list[bytes] = []

    def sink(array: bytes) -> bool:
        offered.append(array)
        try:
            return all(isinstance(e, dict) and "ph" in e for e in json.loads(array))
        except json.JSONDecodeError:
            return False

    header = TraceHeader()
    assert [b for b in read_trace(path, header, raw_sink=sink)] == []  # all taken by the sink
    assert len(offered) == 1 and len(json.loads(offered[0])) == 50
    assert header.metadata["deviceProperties"] == [{"id": 0, "name": "H100"}]
