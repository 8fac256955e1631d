"""``kill -9`` in the middle of ingest loses nothing and duplicates nothing (real chDB, real SIGKILL).

A child process (its own chDB directory) writes rows ``seq = 0..N-1`` through the writer and
prints ``acked K`` after each submit returns. Run 1 kills itself with SIGKILL right after its
third insert, before deleting that batch's spool file (the replay-duplicate case). Run 2 resumes
and is SIGKILLed by the test at a random moment mid-ingest. Run 3 resumes and finishes. Each run
first replays the spool and resumes at ``max(seq) + 1`` of what is in the store, so a lost
acknowledged row would show as a resume point at or below the last ack of the run before; a
duplicate shows as ``count() != uniqExact(seq)``.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

N = 60_000
CHILD = r'''
import json, os, signal, sys, time
from triscope.store import open_store
from triscope.schema import Column, Table
from triscope.writer import Writer

store_dir, spool_dir, total, crash_after = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = open_store({"store": {"backend": "embedded", "path": store_dir, "database": "killtest"}})
store.command("CREATE TABLE IF NOT EXISTS killtest.seqs (seq UInt64, ts DateTime64(9, 'UTC'), "
              "payload String) ENGINE = MergeTree PARTITION BY toYYYYMMDD(ts) ORDER BY seq")
SEQS = Table("seqs", [Column("seq", "UInt64"), Column("ts", "DateTime64(9, 'UTC')"), Column("payload", "String")],
             order_by="seq")
writer = Writer(store, spool_dir, batch_rows=4000, flush_interval_s=0.05, tables=[SEQS])
replay = writer.snapshot()["rows_pending"]
writer.start()
assert writer.flush(timeout_s=60)
start = int(store.query("SELECT if(count() = 0, 0, max(seq) + 1) FROM killtest.seqs").scalar())
print(json.dumps({"resume": start, "replayed": writer.snapshot()["rows_replayed"], "spooled": replay}), flush=True)
if crash_after:
    real_remove, inserts = writer.spool.remove, [0]
    def remove(item):
        inserts[0] += 1
        if inserts[0] == crash_after:
            os.kill(os.getpid(), signal.SIGKILL)  # inserted, spool file not yet deleted
        real_remove(item)
    writer.spool.remove = remove
for lo in range(start, total, 500):
    seqs = list(range(lo, min(lo + 500, total)))
    writer.submit(SEQS, {"seq": seqs, "ts": [f"2026-12-0{1 + s % 2} 00:00:00.{s:09d}" for s in seqs],
                           "payload": ["x" * (s % 50) for s in seqs]})
    print(f"acked {seqs[-1]}", flush=True)
    time.sleep(0.004)
writer.close()
r = store.query("SELECT count(), uniqExact(seq), min(seq), max(seq) FROM killtest.seqs").rows[0]
print(json.dumps({"count": r[0], "unique": r[1], "min": r[2], "max": r[3]}), flush=True)
'''


def _child(tmp: Path, crash_after: int = 0) -> subprocess.Popen[str]:
    script = tmp / "child.py"
    script.write_text(CHILD)
    return subprocess.Popen([sys.executable, str(script), str(tmp / "chdb"), str(tmp / "spool"), str(N),
                             str(crash_after)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read_until_acks(proc: subprocess.Popen[str], acks: int) -> tuple[dict, int]:
    """The child's resume line and its last ack, after ``acks`` ack lines (or its exit)."""
    assert proc.stdout is not None
    head = json.loads(proc.stdout.readline() or "{}")
    last, seen = -1, 0
    for line in proc.stdout:
        if line.startswith("acked "):
            last, seen = int(line.split()[1]), seen + 1
            if seen >= acks:
                break
    return head, last


def test_sigkill_mid_ingest_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    # Run 1: SIGKILL right after the third insert, before its spool file is deleted.
    first = _child(tmp_path, crash_after=3)
    head1, acked1 = _read_until_acks(first, acks=10**9)  # reads to EOF: every ack before the kill
    first.wait(timeout=120)
    assert first.returncode == -signal.SIGKILL, first.stderr.read() if first.stderr else ""
    assert head1["resume"] == 0 and acked1 >= 3 * 4000 - 1

    # Run 2: replays run 1's spool (including the already inserted batch), then dies at random.
    second = _child(tmp_path)
    head2, acked2 = _read_until_acks(second, acks=random.randint(5, 25))
    time.sleep(random.uniform(0.0, 0.05))
    second.send_signal(signal.SIGKILL)
    rest = second.communicate(timeout=60)[0]
    acked2 = max([acked2] + [int(x.split()[1]) for x in rest.splitlines() if x.startswith("acked ")])
    assert head2["spooled"] > 0 and head2["replayed"] == head2["spooled"]
    assert head2["resume"] > acked1  # every row acknowledged by run 1 is in the store

    # Run 3: replays run 2's spool and finishes.
    third = _child(tmp_path)
    out, err = third.communicate(timeout=180)
    assert third.returncode == 0, err[-2000:]
    lines = out.splitlines()
    head3, final = json.loads(lines[0]), json.loads(lines[-1])
    assert head3["resume"] > acked2, (head3, acked2)  # every row acknowledged before the kill is there
    assert final == {"count": N, "unique": N, "min": 0, "max": N - 1}
