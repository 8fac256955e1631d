"""Files that are not Kineto traces, and files of other jobs: refused with one line, nothing left behind.

The not-a-trace inputs are real PyTorch outputs made with torch on the CPU (tests/data/not_kineto/README.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import TEST_DATA, shared_data
from kineto_helpers import kernel, write_trace

from triscope.collectors.kineto import ingest_paths, ingest_trace
from triscope.collectors.kineto.errors import NotATraceError, OtherJobError, RankTakenError, SkippedTraceError
from triscope.errors import InputError
from triscope.schema import qualified

NOT_KINETO = TEST_DATA / "not_kineto"
CASES = {
    "execution_trace.json": "execution trace",
    "memory_timeline.json": "JSON array",
    "memory_timeline_raw.json.gz": "JSON array",
    "memory_snapshot.pickle": "pickle",
}
DAY_NS = 86_400 * 10**9


def _count(store, table: str) -> int:
    return int(store.query(f"SELECT count() FROM {qualified(store, table)}").scalar())


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_file_that_is_not_a_kineto_trace_is_refused_and_leaves_no_run(store, name: str) -> None:
    with pytest.raises(NotATraceError, match=CASES[name]) as info:
        ingest_trace(store, NOT_KINETO / name, run_id="x")
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(NOT_KINETO / name)) and "not a Kineto trace" in message
    assert _count(store, "trace_runs") == 0 and _count(store, "trace_events") == 0  # no 0-event partial run


@pytest.mark.parametrize("payload, what", [
    (b"", "empty file"),
    (b"   \n", "empty file"),
    (b'{"schemaVersion": 1, "other": []}', "no traceEvents array"),
    (b"<html><body>memory</body></html>", "HTML"),
    (b'"just a string"', "not a JSON object"),
])
def test_other_inputs_are_refused_before_anything_is_stored(store, tmp_path: Path, payload: bytes, what: str):
    path = tmp_path / "odd.json"
    path.write_bytes(payload)
    with pytest.raises(NotATraceError, match=what):
        ingest_trace(store, path, run_id="odd")
    assert _count(store, "trace_runs") == 0


def test_a_gzip_corrupt_from_its_start_leaves_no_run(store, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)) * 8)
    with pytest.raises(InputError, match="corrupt or cut short"):
        ingest_trace(store, bad, run_id="bad")
    assert _count(store, "trace_runs") == 0


def test_in_a_directory_they_are_skipped_with_a_warning_not_phantom_ranks(store, tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    for rank in range(2):
        write_trace(job / f"rank{rank}.json", [kernel("k", 1, 1)], distributedInfo={"rank": rank, "world_size": 2})
    for name in ("execution_trace.json", "memory_timeline.json"):
        shutil.copy(NOT_KINETO / name, job / name)
    outcomes: list = []
    results = ingest_paths(store, [job], on_file=outcomes.append)
    assert sorted(r.rank for r in results) == [0, 1]
    skipped = [o for o in outcomes if isinstance(o, SkippedTraceError)]
    assert len(skipped) == 2 and all("skipped" in str(s) and "\n" not in str(s) for s in skipped)
    assert store.query(f"SELECT rank FROM {qualified(store, 'trace_runs')} FINAL ORDER BY rank").rows == [(0,), (1,)]


def test_a_file_without_rank_info_gets_the_default_rank_not_its_position(store, tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    write_trace(job / "a.json", [kernel("a", 1, 1)], distributedInfo={"rank": 3})
    write_trace(job / "b.json", [kernel("b", 1, 1)])  # no rank in metadata or name: rank 0, not index 1
    results = ingest_paths(store, [job])
    assert sorted((r.path.rsplit("/", 1)[1], r.rank) for r in results) == [("a.json", 3), ("b.json", 0)]
    job2 = tmp_path / "job2"
    job2.mkdir()
    for name in ("x.json", "y.json"):
        write_trace(job2 / name, [kernel(name, 1, 1)])
    errors: list = []
    results = ingest_paths(store, [job2], on_file=lambda o: errors.append(o) if isinstance(o, InputError) else None)
    assert [r.rank for r in results] == [0]
    assert len(errors) == 1 and isinstance(errors[0], RankTakenError) and "no rank in its metadata" in str(errors[0])
    assert store.query(f"SELECT DISTINCT rank FROM {qualified(store, 'trace_events')} WHERE run_id = 'job2'").rows \
        == [(0,)]


def test_a_rank_only_in_the_tail_of_a_later_file_still_lands_on_it(store, tmp_path: Path) -> None:
    """Ranks found only after the events: the first file holds the default rank meanwhile, the second
    a provisional one; both end on their real ranks."""
    job = tmp_path / "tail"
    job.mkdir()
    for rank in (1, 0):
        (job / f"t{rank}.json").write_text(json.dumps({"traceEvents": [kernel(f"k{rank}", 1, 1)],
                                                       "distributedInfo": {"rank": rank}}))
    results = ingest_paths(store, [job])
    assert sorted(r.rank for r in results) == [0, 1]
    assert sorted(store.query(f"SELECT rank, name FROM {qualified(store, 'trace_events')}").rows) \
        == [(0, "k0"), (1, "k1")]


def _job_file(path: Path, rank: int, world: int, base_ns: int) -> Path:
    return write_trace(path, [kernel("k", 10, 5)], distributedInfo={"rank": rank, "world_size": world},
                       baseTimeNanoseconds=base_ns)


def test_files_of_another_job_in_one_directory_are_refused(store, tmp_path: Path) -> None:
    base = 1_767_225_600 * 10**9
    job = tmp_path / "mixed"
    job.mkdir()
    for rank in range(3):
        _job_file(job / f"a_rank{rank}.json", rank, 4, base + rank * 10**9)
    _job_file(job / "b_rank5.json", 5, 8, base)  # another world size
    _job_file(job / "c_rank3.json.gz", 3, 4, base + 2 * DAY_NS)  # same world size, two days later
    outcomes: list = []
    results = ingest_paths(store, [job], on_file=outcomes.append)
    assert sorted(r.rank for r in results) == [0, 1, 2]
    refused = {Path(str(o).split(":")[0]).name: str(o) for o in outcomes if isinstance(o, OtherJobError)}
    assert set(refused) == {"b_rank5.json", "c_rank3.json.gz"}
    assert "world size 8, the others 4" in refused["b_rank5.json"]
    assert "2.0 days after the others" in refused["c_rank3.json.gz"]
    assert store.query(f"SELECT DISTINCT rank FROM {qualified(store, 'trace_events')} ORDER BY rank").rows \
        == [(0,), (1,), (2,)]
    assert store.query(f"SELECT rank FROM {qualified(store, 'trace_runs')} FINAL ORDER BY rank").rows \
        == [(0,), (1,), (2,)]


def test_ranks_of_one_real_job_stay_together(store, tmp_path: Path) -> None:
    job = tmp_path / "sampled"
    job.mkdir()
    for rank in (0, 1):
        shutil.copy(shared_data("kineto", f"sampled_128rank_job_rank{rank}.json.gz"), job)
    outcomes: list = []
    results = ingest_paths(store, [job], on_file=outcomes.append)
    assert sorted(r.rank for r in results) == [0, 1] and not any(isinstance(o, InputError) for o in outcomes)
    assert {r.world_size for r in results} == {128}
