"""Hostile compressed traces: a gzip bomb is refused at the configured size, whitespace is skipped while
streaming in bounded memory, and every member of a multi-member gzip is read."""

from __future__ import annotations

import gzip
import io
import json
import tracemalloc
import zlib
from pathlib import Path

import pytest
from conftest import own_process
from kineto_helpers import kernel, load_json

from triscope.collectors.kineto import ingest_trace
from triscope.collectors.kineto.config import TraceIngestConfig
from triscope.collectors.kineto.errors import TraceTooLargeError
from triscope.collectors.kineto.gzip_stream import GzipStream
from triscope.collectors.kineto.reader import read_all, read_trace
from triscope.errors import ConfigError, InputError
from triscope.schema import qualified

MIB = 1 << 20


def _bomb(path: Path, whitespace_mib: int, events: int = 3) -> Path:
    """A gzip trace with ``whitespace_mib`` MiB of spaces after its first event (one compressed member,
    written without ever holding the expanded text)."""
    first, rest = [kernel("k0", 0, 1)], [kernel(f"k{i}", i * 10, 1) for i in range(1, events)]
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    out = [z.compress(b'{"traceEvents": [' + json.dumps(first[0]).encode())]
    spaces = b" " * MIB
    out += [z.compress(spaces) for _ in range(whitespace_mib)]
    out.append(z.compress(b"".join(b", " + json.dumps(e).encode() for e in rest) + b"]}"))
    out.append(z.flush())
    path.write_bytes(b"".join(out))
    return path


def _count(store, table: str) -> int:
    return int(store.query(f"SELECT count() FROM {qualified(store, table)}").scalar())


def test_a_gzip_bomb_is_refused_at_the_cap_and_leaves_nothing(store, tmp_path: Path) -> None:
    bomb = _bomb(tmp_path / "bomb.json.gz", whitespace_mib=64)
    assert bomb.stat().st_size < 200_000  # 64 MiB of spaces in ~64 KB
    with pytest.raises(TraceTooLargeError, match=r"decompresses to more than 8,388,608 bytes") as info:
        ingest_trace(store, bomb, run_id="bomb", max_decompressed_bytes=8 * MIB)
    assert "\n" not in str(info.value) and "max_decompressed_bytes" in str(info.value)
    assert _count(store, "trace_events") == 0 and _count(store, "trace_runs") == 0
    # The same file under a cap it fits in goes in whole.
    result = ingest_trace(store, bomb, run_id="fits", max_decompressed_bytes=128 * MIB)
    assert result.status == "complete" and result.events == 3


def test_one_inflate_call_never_expands_past_what_was_asked(tmp_path: Path) -> None:
    """Each read inflates at most ``size`` bytes, so 1 MiB of compressed spaces (~1 GiB expanded) never
    lands in memory at once."""
    bomb = _bomb(tmp_path / "bomb.json.gz", whitespace_mib=16)
    assert bomb.stat().st_size < MIB  # the first raw read takes it all: 16 MiB if inflated in one go
    with GzipStream(open(bomb, "rb")) as stream:
        sizes = [len(stream.read(MIB)) for _ in range(10)]
    assert sizes == [MIB] * 10


@own_process
def test_whitespace_is_skipped_while_streaming_in_bounded_memory(tmp_path: Path) -> None:
    bomb = _bomb(tmp_path / "spaces.json.gz", whitespace_mib=200, events=5)
    tracemalloc.start()
    try:
        names = [e.name for block in read_trace(bomb, block_bytes=MIB) for e in block]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert names == [f"k{i}" for i in range(5)]
    assert peak < 160 * MIB, peak  # 200 MiB of whitespace never held: at most 64 MiB of it (~130 MiB peak)


def test_whitespace_between_events_goes_into_the_store_exactly(store, tmp_path: Path) -> None:
    bomb = _bomb(tmp_path / "spaces.json.gz", whitespace_mib=80, events=4)
    result = ingest_trace(store, bomb, run_id="ws")
    assert result.status == "complete" and result.events == 4
    names = store.query(f"SELECT name FROM {qualified(store, 'trace_events')} ORDER BY ts_ns").rows
    assert [n for (n,) in names] == ["k0", "k1", "k2", "k3"]


@own_process
def test_an_event_without_end_is_damage_within_a_bounded_buffer(tmp_path: Path) -> None:
    """One string of 100 MiB (no event boundary anywhere): an error after at most 64 MiB held, not the
    whole file in memory."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [z.compress(b'{"traceEvents": [' + json.dumps(kernel("k0", 0, 1)).encode() + b', {"name": "')]
    parts += [z.compress(b"A" * MIB) for _ in range(100)]
    parts += [z.compress(b'"}]}'), z.flush()]
    path = tmp_path / "long.json.gz"
    path.write_bytes(b"".join(parts))
    got: list[str] = []
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match="no event boundary within"):
            for block in read_trace(path, block_bytes=MIB):
                got += [e.name for e in block]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 300 * MIB, peak


def _members(doc: bytes, cuts: list[int]) -> bytes:
    """``doc`` gzipped as one member per piece between ``cuts``."""
    bounds = [0, *cuts, len(doc)]
    return b"".join(gzip.compress(doc[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))


def test_every_member_of_a_multi_member_gzip_is_read(store, tmp_path: Path) -> None:
    events = [kernel(f"k{i}", i, 1, correlation=i) for i in range(2000)]
    doc = json.dumps({"traceEvents": events, "distributedInfo": {"rank": 4}}, indent=1).encode()
    path = tmp_path / "members.json.gz"
    path.write_bytes(_members(doc, [len(doc) // 3 + 7, len(doc) // 2, 2 * len(doc) // 3 + 1]))
    assert load_json(path)["traceEvents"] == events  # the stdlib reads all members too
    header, got = read_all(path)
    assert [e.name for e in got] == [e["name"] for e in events] and header.rank == 4
    result = ingest_trace(store, path, run_id="members")
    assert result.status == "complete" and result.events == 2000 and result.rank == 4


def test_a_member_ending_exactly_at_a_read_boundary(tmp_path: Path) -> None:
    first, second = gzip.compress(b'{"traceEvents": [{"ph": "X", "name": "a"},'), gzip.compress(
        b' {"ph": "X", "name": "b"}]}')
    for chunk in (len(first), len(first) - 1, 1, 7):
        stream = GzipStream(io.BytesIO(first + second), chunk=chunk)  # type: ignore[arg-type]
        out = b"".join(iter(lambda s=stream: s.read(5), b""))
        assert out == b'{"traceEvents": [{"ph": "X", "name": "a"}, {"ph": "X", "name": "b"}]}', chunk
        assert stream.members == 2


def test_the_limit_is_a_typed_config_key() -> None:
    assert TraceIngestConfig.from_config({}).max_decompressed_bytes == 8 << 30
    assert TraceIngestConfig.from_config({"ingest": {"max_decompressed_bytes": 1024}}).max_decompressed_bytes == 1024
    with pytest.raises(ConfigError, match=r"^\[ingest\] max_decompressed_bytes must be > 0"):
        TraceIngestConfig.from_config({"ingest": {"max_decompressed_bytes": -1}})
    with pytest.raises(ConfigError, match="unknown keys: max_bytes"):
        TraceIngestConfig.from_config({"ingest": {"max_bytes": 1}})
    with pytest.raises(ConfigError, match="bad value for max_decompressed_bytes"):
        TraceIngestConfig.from_config({"ingest": {"max_decompressed_bytes": "8G"}})
