"""Kineto ingest into the real engine: every sample trace, both parse paths, eras, joins, damage."""

from __future__ import annotations

import gzip
import json
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest
from conftest import SHARED_DATA, shared_data
from kineto_helpers import GPU_CATEGORIES, complete_events, cpu, kernel, load_json, runtime, write_trace

from triscope.collectors.kineto import ingest_paths, ingest_trace
from triscope.errors import InputError
from triscope.schema import qualified

SAMPLES = sorted((SHARED_DATA / "kineto").glob("*.json*")) if (SHARED_DATA / "kineto").exists() else []
EVENT_COLUMNS = "kind, category, kernel_class, name, pid, tid, device, stream, ts_ns, dur_ns, correlation, " \
                "external_id, collective, in_nelems, out_nelems, group_size, dtype, pg_name, pg_ranks"


def _rows(store, run_id: str) -> list[tuple]:
    return store.query(f"SELECT {EVENT_COLUMNS} FROM {qualified(store, 'trace_events')} "
                       "WHERE run_id = {r:String} ORDER BY ts_ns, name, kind, correlation, dur_ns, tid",
                       {"r": run_id}).rows


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_every_sample_trace_ingests_completely(store, path: Path):
    doc = load_json(path, exact=True)
    expected = complete_events(doc)
    result = ingest_trace(store, path, run_id="r")
    assert result.status == "complete"
    assert result.events == len(expected)
    assert result.gpu_events == sum(1 for e in expected if e.get("cat") in GPU_CATEGORIES)
    base = int(doc.get("baseTimeNanoseconds") or 0)
    assert result.base_time_ns == base
    got = store.query(f"SELECT min(ts_ns), max(ts_ns + dur_ns) FROM {qualified(store, 'trace_events')}").rows[0]
    lo = min(_ns(e["ts"]) for e in expected)
    hi = max(_ns(e["ts"]) + _ns(e.get("dur", 0)) for e in expected)
    assert got == (lo, hi)


def _ns(us: Decimal | int) -> int:
    """Exact nanoseconds of a JSON microsecond value read as Decimal."""
    return int((Decimal(us) * 1000).to_integral_value(rounding=ROUND_HALF_UP))


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_clickhouse_and_python_parse_paths_store_identical_rows(store, path: Path):
    ingest_trace(store, path, run_id="fast")
    ingest_trace(store, path, run_id="slow", use_clickhouse_json=False)
    assert _rows(store, "fast") == _rows(store, "slow")


def test_timestamp_eras_and_joins(store):
    a100 = shared_data("kineto", "a100_ddp_2024_rank0.json.gz")  # relative ts + baseTimeNanoseconds
    legacy = shared_data("kineto", "legacy_inference_tiny_2022.json.gz")  # absolute epoch us, 2022 categories
    r1 = ingest_trace(store, a100, run_id="a100")
    r2 = ingest_trace(store, legacy, run_id="legacy")
    runs = dict(store.query(f"SELECT run_id, time_base FROM {qualified(store, 'trace_runs')}").rows)
    assert runs == {"a100": "relative", "legacy": "absolute"}
    assert r1.base_time_ns == 1711964646000000000 and r2.base_time_ns == 0
    # Absolute era: ns timestamps are epoch values in 2022.
    ts = store.query(f"SELECT min(ts_ns) FROM {qualified(store, 'trace_events')} WHERE run_id = 'legacy'").scalar()
    assert 1_640_000_000 * 10**9 < ts < 1_700_000_000 * 10**9
    # Legacy Kernel/Runtime categories map to kernel/runtime, and the lowercase 'external id' is read.
    kinds = dict(store.query(f"SELECT kind, count() FROM {qualified(store, 'trace_events')} "
                             "WHERE run_id = 'legacy' GROUP BY kind").rows)
    assert kinds["kernel"] == 4 and kinds["runtime"] == 8
    # correlation joins every a100 kernel to its runtime launch.
    unmatched = store.query(f"""
        SELECT count() FROM {qualified(store, 'trace_events')} AS k
        LEFT ANTI JOIN (SELECT correlation FROM {qualified(store, 'trace_events')}
                        WHERE run_id = 'a100' AND kind = 'runtime') AS r USING correlation
        WHERE k.run_id = 'a100' AND k.kind = 'kernel'""").scalar()
    assert unmatched == 0
    doc = load_json(a100)
    first = min((e for e in doc["traceEvents"] if e.get("cat") == "kernel" and e["name"].startswith("nccl")),
                key=lambda e: e["ts"])
    comm = store.query(f"SELECT name, collective, in_nelems, group_size, dtype, pg_ranks "
                       f"FROM {qualified(store, 'trace_events')} WHERE run_id = 'a100' AND kernel_class = 'comm' "
                       "ORDER BY ts_ns LIMIT 1").rows[0]
    a = first["args"]
    assert comm == (first["name"], a["Collective name"], a["In msg nelems"], a["Group size"], a["dtype"],
                    a["Process Group Ranks"])
    params = store.query(f"SELECT count() FROM {qualified(store, 'trace_events')} WHERE run_id = 'a100' "
                         "AND name = 'record_param_comms' AND collective != ''").scalar()
    assert params > 0


def test_kernel_classes_by_category_and_name(store, tmp_path: Path):
    events = [
        kernel("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", 10, 5),
        kernel("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", 20, 5),
        kernel("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*, int)", 30, 5),
        kernel("triton_poi_fused_add_0", 40, 5),
        kernel("Memcpy HtoD (Pageable -> Device)", 50, 5, cat="gpu_memcpy"),
        kernel("Memset (Device)", 60, 5, cat="gpu_memset"),
        # A Triton host op carries stream 0 but is CPU work.
        {"ph": "X", "cat": "cpu_op", "name": "triton_poi_fused_add_0", "pid": 1, "tid": 1, "ts": 39, "dur": 1,
         "args": {"stream": 0, "device": 0}},
        cpu("aten::mm", 5, 2),
        {"ph": "i", "name": "instant", "pid": 1, "tid": 1, "ts": 1, "s": "g"},
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},
    ]
    path = write_trace(tmp_path / "classes.json", events)
    result = ingest_trace(store, path, run_id="c")
    assert result.events == 8 and result.gpu_events == 6
    got = dict(store.query(f"SELECT name, kernel_class FROM {qualified(store, 'trace_events')} "
                           "WHERE kind IN ('kernel', 'memcpy', 'memset')").rows)
    assert [got[e["name"]] for e in events[:6]] == ["comm", "comm", "comm", "compute", "memory", "memory"]
    host = store.query(f"SELECT kind, kernel_class FROM {qualified(store, 'trace_events')} "
                       "WHERE name = 'triton_poi_fused_add_0' AND category = 'cpu_op'").rows
    assert host == [("cpu_op", "")]


def test_truncated_trace_keeps_earlier_rows_and_other_runs(store, tmp_path: Path):
    good = write_trace(tmp_path / "good.json", [kernel(f"g{i}", i, 1) for i in range(50)])
    ingest_trace(store, good, run_id="good")
    events = [kernel(f"k{i}", i, 1, correlation=i) for i in range(3000)]
    data = json.dumps({"traceEvents": events}, indent=2).encode()
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(data)[: len(gzip.compress(data)) * 2 // 3])
    with pytest.raises(InputError) as info:
        ingest_trace(store, cut, run_id="cut")
    assert "\n" not in str(info.value)
    run = store.query(f"SELECT status, event_count, error FROM {qualified(store, 'trace_runs')} FINAL "
                      "WHERE run_id = 'cut'").rows[0]
    assert run[0] == "partial" and 0 < run[1] < 3000 and run[2]
    kept = store.query(f"SELECT name FROM {qualified(store, 'trace_events')} WHERE run_id = 'cut' "
                       "ORDER BY ts_ns").rows
    assert [r[0] for r in kept] == [f"k{i}" for i in range(len(kept))]
    assert store.query(f"SELECT count() FROM {qualified(store, 'trace_events')} "
                       "WHERE run_id = 'good'").scalar() == 50


def test_garbage_gzip_is_refused_without_touching_the_store(store, tmp_path: Path):
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)) * 8)
    with pytest.raises(InputError, match="corrupt or cut short"):
        ingest_trace(store, bad, run_id="bad")
    assert store.query(f"SELECT count() FROM {qualified(store, 'trace_events')}").scalar() == 0


def test_reingest_replaces_instead_of_duplicating(store, tmp_path: Path):
    path = write_trace(tmp_path / "t_rank2.json", [kernel(f"k{i}", i, 1) for i in range(10)])
    ingest_trace(store, path)
    ingest_trace(store, path)
    assert store.query(f"SELECT count() FROM {qualified(store, 'trace_events')}").scalar() == 10
    assert store.query(f"SELECT run_id, rank FROM {qualified(store, 'trace_runs')} FINAL").rows == [("t_rank2", 2)]


def test_multi_rank_directory_is_one_run(store, tmp_path: Path):
    job = tmp_path / "job7"
    job.mkdir()
    for rank in range(3):
        write_trace(job / f"worker{rank}.json", [kernel("k", rank * 10, 1)] * (rank + 1),
                    distributedInfo={"rank": rank, "world_size": 3})
    (job / "notes.txt").write_text("not a trace")
    results = ingest_paths(store, [job])
    assert sorted((r.run_id, r.rank, r.events) for r in results) == [("job7", 0, 1), ("job7", 1, 2), ("job7", 2, 3)]


def test_rank_known_only_from_the_tail_rekeys_rows(store, tmp_path: Path):
    path = tmp_path / "late.json"
    path.write_text(json.dumps({"traceEvents": [kernel("k", 1, 1), runtime("cudaLaunchKernel", 0, 1, 5)],
                                "distributedInfo": {"rank": 5}}))
    result = ingest_trace(store, path, run_id="late")
    assert result.rank == 5
    assert store.query(f"SELECT DISTINCT rank FROM {qualified(store, 'trace_events')}").rows == [(5,)]


def test_same_rank_twice_in_one_batch_is_refused(store, tmp_path: Path):
    job = tmp_path / "mixed"
    job.mkdir()
    for name in ("a", "b"):
        write_trace(job / f"{name}.json", [kernel(name, 1, 1)], distributedInfo={"rank": 0})
    errors = []
    results = ingest_paths(store, [job], on_file=lambda o: errors.append(o) if isinstance(o, InputError) else None)
    assert len(results) == 1 and len(errors) == 1 and "already ingested" in str(errors[0])
    assert store.query(f"SELECT name FROM {qualified(store, 'trace_events')}").rows == [("a",)]
    runs = store.query(f"SELECT source_path, rank, status FROM {qualified(store, 'trace_runs')} FINAL").rows
    assert runs == [(str(job / "a.json"), 0, "complete")]  # the refused file did not overwrite a's run


def test_same_rank_found_only_in_the_tail_leaves_nothing_of_the_second_file(store, tmp_path: Path):
    """The second file's rank is only known at its end (distributedInfo after traceEvents): its rows,
    stored under the guessed rank meanwhile, go again when the rank turns out to be taken."""
    job = tmp_path / "late"
    job.mkdir()
    write_trace(job / "a.json", [kernel("a", 1, 1)], distributedInfo={"rank": 0})
    (job / "b.json").write_text(json.dumps({"traceEvents": [kernel("b", 1, 1)], "distributedInfo": {"rank": 0}}))
    errors: list[InputError] = []
    results = ingest_paths(store, [job], on_file=lambda o: errors.append(o) if isinstance(o, InputError) else None)
    assert [(r.rank, r.status) for r in results] == [(0, "complete")]
    assert len(errors) == 1 and "already ingested" in str(errors[0])
    assert store.query(f"SELECT rank, name FROM {qualified(store, 'trace_events')}").rows == [(0, "a")]
    assert store.query(f"SELECT rank FROM {qualified(store, 'trace_runs')} FINAL").rows == [(0,)]


def test_blocks_clickhouse_refuses_are_replaced_not_duplicated(store, tmp_path: Path):
    # Compact JSON whose names contain the block separator: some cuts land inside strings, so
    # ClickHouse rejects those blocks after writing part of them; those rows must go again.
    events = [kernel(f'k{i} }},{{"x":1}}', ts=i, dur=1, correlation=i) for i in range(2000)]
    path = write_trace(tmp_path / "tricky.json", events, compact=True)
    result = ingest_trace(store, path, run_id="tricky", block_bytes=4096, stream=False)
    names = [r[0] for r in store.query(f"SELECT name FROM {qualified(store, 'trace_events')} ORDER BY ts_ns").rows]
    assert result.events == 2000 and names == [e["name"] for e in events]
    blocks = store.query(f"SELECT countIf(ingest_block = 0), countIf(ingest_block > 0) "
                         f"FROM {qualified(store, 'trace_events')}").rows[0]
    assert blocks[0] > 0  # some blocks really went through the Python decoder


def test_odd_argument_types_read_the_same_on_both_parse_paths(store, tmp_path: Path):
    """Floats, numeric, padded and hex strings, booleans, nulls, nested objects, values beyond Int64
    and both external-id spellings in ``args``: ClickHouse's extraction and the Python decoder store
    the same values (before, a boolean or an object made the Python decoder call the trace corrupt,
    and an integer beyond Int64 failed the whole insert batch)."""
    odd = [
        {"device": 1.0, "stream": "7", "correlation": 12.9},
        {"device": "0x0", "stream": None, "correlation": "0x1f", "external id": 5},
        {"device": True, "stream": -3, "External id": "41", "external id": 9},
        {"device": {"nested": 1}, "stream": [1, 2], "correlation": 1e3},
        {"device": "2", "stream": " 8 ", "correlation": -0.5, "External id": 2.5},
        {"device": 2**63, "stream": -(2**63) - 1, "correlation": "1e3", "External id": "9223372036854775807"},
        {"device": 2**40, "stream": "1.9e1", "correlation": ".5", "External id": False},
        {},
    ]
    events = [kernel(f"k{i}", ts=10.0 * i, dur=1.5, **{}) for i in range(len(odd))]
    for event, args in zip(events, odd, strict=True):
        event["args"] = args
    comm = kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", ts=100.0, dur=3.0)
    comm["args"].update({"Collective name": "allreduce", "In msg nelems": "1024", "Out msg nelems": 1024.0,
                         "Group size": 2, "dtype": 7, "Process Group Name": "0", "Process Group Ranks": True})
    path = write_trace(tmp_path / "odd.json", [*events, comm, runtime("cudaLaunchKernel", 1.0, 2.0, correlation=3)])
    ingest_trace(store, path, run_id="fast")
    ingest_trace(store, path, run_id="slow", use_clickhouse_json=False)
    fast, slow = _rows(store, "fast"), _rows(store, "slow")
    assert len(fast) == len(odd) + 2
    assert fast == slow


def test_args_that_are_not_objects_read_as_absent_on_both_parse_paths(store, tmp_path: Path):
    """An ``args`` array, string, number or null carries none of the keys read: both parse paths store
    the event with default device, stream and correlation (before, the Python decoder called the
    trace corrupt while ClickHouse took it)."""
    events = [kernel(f"k{i}", ts=10.0 * i, dur=1.0, correlation=i + 1) for i in range(5)]
    for event, args in zip(events[1:], ([1, 2], "hello", 42, None), strict=True):
        event["args"] = args
    path = write_trace(tmp_path / "args.json", events)
    ingest_trace(store, path, run_id="fast")
    ingest_trace(store, path, run_id="slow", use_clickhouse_json=False)
    fast, slow = _rows(store, "fast"), _rows(store, "slow")
    assert fast == slow and len(fast) == 5
    assert [r[10] for r in fast] == [1, 0, 0, 0, 0]  # correlation only where args is an object


@pytest.mark.parametrize("field, value, message", [
    ("ts", 1e30, "ts 1E[+]30 us is outside the Int64 nanosecond range"),
    ("ts", 12 * 10**28, "outside the Int64 nanosecond range"),
    ("dur", -1e20, "dur -1E[+]20 us is outside the Int64 nanosecond range"),
    ("name", "bad\\ud800name", "lone UTF-16 surrogate"),
])
@pytest.mark.parametrize("python_only", [False, True], ids=["clickhouse-json", "python"])
def test_an_event_the_store_cannot_hold_is_named_and_the_ones_before_it_kept(
        store, tmp_path: Path, field: str, value, message: str, python_only: bool):
    """A time beyond Int64 nanoseconds or a lone surrogate: a one-line InputError naming the event's
    byte offset (before, ClickHouse's cast error failed the whole insert as a StoreError), with the
    events before it stored, the partial run recorded, and the other runs untouched."""
    ingest_trace(store, write_trace(tmp_path / "good.json", [kernel("g", 1, 1)]), run_id="good")
    events = [kernel(f"k{i}", ts=i, dur=1, correlation=i) for i in range(300)]
    bad = dict(events[200])
    bad[field] = "NAME" if field == "name" else value
    events[200] = bad
    path = write_trace(tmp_path / "bad.json", events)
    text = path.read_text()
    if field == "name":
        path.write_text(text.replace('"NAME"', f'"{value}"'))
    offset = path.read_bytes().index(b'"name": "k199"')  # the invalid event starts after this one
    with pytest.raises(InputError, match=message) as info:
        ingest_trace(store, path, run_id="bad", block_bytes=2048, use_clickhouse_json=not python_only)
    error = str(info.value)
    assert "\n" not in error and str(path) in error
    at = int(error.split(" at byte ")[1].split(";")[0])
    assert offset < at < path.read_bytes().index(b'"name": "k201"')
    kept = [r[0] for r in store.query(f"SELECT name FROM {qualified(store, 'trace_events')} WHERE run_id = 'bad' "
                                      "ORDER BY ts_ns").rows]
    assert kept == [f"k{i}" for i in range(200)]
    run = store.query(f"SELECT status, event_count FROM {qualified(store, 'trace_runs')} FINAL "
                      "WHERE run_id = 'bad'").rows
    assert run == [("partial", 200)]
    assert store.query(f"SELECT count() FROM {qualified(store, 'trace_events')} WHERE run_id = 'good'").scalar() == 1


def test_spilled_halves_hold_the_same_events_and_give_back_the_exact_bytes():
    from triscope.collectors.kineto.pipeline import spill_block

    events = [kernel(f"k{i}", ts=float(i), dur=1.0, correlation=i) for i in range(3000)]
    text = json.dumps(events, indent=1).encode()
    buf = text[1:-1] + b',\n {"partial": '  # the reader's buffer: the block, then the next event's start
    end = len(text) - 2
    spill = spill_block(buf, end, min_split_bytes=1024)
    try:
        halves = [part.read_bytes() for part in spill.parts]
        assert len(halves) == 2 and all(len(h) < 0.6 * len(text) for h in halves)
        assert json.loads(halves[0]) + json.loads(halves[1]) == events
        assert spill.events() == buf[:end], "a refused block comes back byte for byte"
    finally:
        spill.remove()
    assert not any(part.exists() for part in spill.parts)
    small = spill_block(buf, end)
    try:
        assert len(small.parts) == 1 and json.loads(small.parts[0].read_bytes()) == events, "below 1 MiB: one insert"
    finally:
        small.remove()
    no_boundary = b"1," * 2000 + b"1"
    one = spill_block(no_boundary, len(no_boundary), min_split_bytes=16)
    try:
        assert len(one.parts) == 1 and one.events() == no_boundary, "no event boundary: one insert"
    finally:
        one.remove()


def test_the_stream_goes_in_as_one_insert_of_big_parts(store, tmp_path: Path):
    """The embedded store takes a whole file through one streaming INSERT (block 1 for every row),
    written in parts of up to 64k rows instead of one small part per block."""
    events = [kernel(f"k{i}", ts=i, dur=1, correlation=i) for i in range(150_000)]
    path = write_trace(tmp_path / "big.json", events, compact=True)
    result = ingest_trace(store, path, run_id="big", block_bytes=1 << 20)
    table = qualified(store, "trace_events")
    assert result.events == 150_000 and result.status == "complete"
    assert store.query(f"SELECT uniqExact(ts_ns), min(ingest_block), max(ingest_block) FROM {table}").rows[0] == (
        150_000, 1, 1)
    parts = store.query("SELECT count(), max(rows) FROM system.parts WHERE database = {db:String} "
                        "AND table = 'trace_events' AND active", {"db": store.database}).rows[0]
    assert parts[0] <= 8 and parts[1] >= 50_000, parts  # about 6 MB of JSON in 1 MiB blocks


def test_a_stream_clickhouse_refuses_goes_in_again_block_by_block(store, tmp_path: Path):
    """An event with a duplicated key is refused by ClickHouse's JSON reader but read by Python's:
    the streamed rows are removed and the file goes in again block by block, each row once."""
    good = [kernel(f"k{i}", ts=i, dur=1, correlation=i) for i in range(3000)]
    text = json.dumps({"traceEvents": good}).encode()
    odd = b'{"ph": "X", "cat": "kernel", "name": "dup", "ts": 5000, "ts": 5001, "dur": 1}, '
    path = tmp_path / "dup.json"
    path.write_bytes(text.replace(b'"traceEvents": [', b'"traceEvents": [' + odd, 1))
    seen: list[int] = []
    result = ingest_trace(store, path, run_id="dup", on_progress=seen.append)
    rows = store.query(f"SELECT name, ts_ns, ingest_block FROM {qualified(store, 'trace_events')} "
                       "ORDER BY ts_ns").rows
    assert result.events == 3001 and len(rows) == 3001
    assert [r[0] for r in rows] == [e["name"] for e in good] + ["dup"]
    assert rows[-1][1] == 5_001_000  # the last value of the key, as Python's JSON reads it
    assert {r[2] for r in rows} == {0}, "every row from the second pass (one block, below 1 MiB: Python)"
    assert seen, "progress was reported"


def test_blocks_split_in_halves_are_replaced_whole_when_a_half_is_refused(store, tmp_path: Path):
    # Blocks over 1 MiB go in as two halves on two threads; names containing the event separator
    # make the half cut (and block cuts) land inside strings: whichever half fails, the whole block
    # goes again through the Python decoder, never twice.
    events = [kernel(f'k{i} }},{{"x":1}}', ts=i, dur=1, correlation=i) for i in range(25_000)]
    path = write_trace(tmp_path / "tricky.json", events, compact=True)
    result = ingest_trace(store, path, run_id="tricky", block_bytes=2 << 20, stream=False)
    names = [r[0] for r in store.query(f"SELECT name FROM {qualified(store, 'trace_events')} ORDER BY ts_ns").rows]
    assert result.events == len(events) and names == [e["name"] for e in events]


def test_a_batch_records_every_run_in_one_insert_also_the_damaged_one(store, tmp_path: Path):
    """ingest_paths writes the trace_runs rows of a batch together (one part, not one per file),
    the partial run of a cut-short file included, with the counts each file stored."""
    job = tmp_path / "job"
    job.mkdir()
    for r in range(3):
        write_trace(job / f"t_rank{r}.json", [kernel(f"r{r}k{i}", i, 1) for i in range(10 + r)])
    data = json.dumps({"traceEvents": [kernel(f"k{i}", i, 1) for i in range(3000)]}, indent=2).encode()
    (job / "t_rank3.json.gz").write_bytes(gzip.compress(data)[: len(gzip.compress(data)) * 2 // 3])
    errors: list[InputError] = []
    results = ingest_paths(store, [job], on_file=lambda o: errors.append(o) if isinstance(o, InputError) else None)
    assert len(errors) == 1 and "cut short" in str(errors[0])
    assert [(r.rank, r.status) for r in results] == [(0, "complete"), (1, "complete"), (2, "complete"),
                                                     (3, "partial")]
    runs = store.query(f"SELECT rank, status, event_count FROM {qualified(store, 'trace_runs')} FINAL "
                       "ORDER BY rank").rows
    assert [r[:2] for r in runs] == [(0, "complete"), (1, "complete"), (2, "complete"), (3, "partial")]
    assert [r[2] for r in runs[:3]] == [10, 11, 12] and 0 < runs[3][2] < 3000
    stored = store.query(f"SELECT rank, count() FROM {qualified(store, 'trace_events')} GROUP BY rank "
                         "ORDER BY rank").rows
    assert [n for _, n in stored] == [r[2] for r in runs]
    parts = store.query("SELECT count() FROM system.parts WHERE database = {db:String} AND table = 'trace_runs' "
                        "AND active", {"db": store.database}).scalar()
    assert parts == 1
