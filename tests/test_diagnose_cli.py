"""``triscope diagnose`` (stalls) and ``triscope nccl`` end to end, each CLI call a subprocess with its own store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from conftest import REPO, free_port, require_binary, shared_data

WORKER = Path(__file__).with_name("nccl_gloo_worker.py")
pytestmark = pytest.mark.slow


def _cli(store_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "TRISCOPE_STORE__PATH": str(store_dir), "COLUMNS": "200", **(env or {})}
    full_env.pop("TRISCOPE_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "triscope", *args], capture_output=True, text=True, env=full_env,
                          cwd=REPO, timeout=300)


def test_sample_gloo_job_report_and_exit_code(tmp_path: Path) -> None:
    db = tmp_path / "db"
    traces = [str(shared_data("kineto", f"local_cpu_gloo_2rank_rank{r}.json")) for r in (0, 1)]
    assert _cli(db, "ingest", "trace", *traces, "--run-id", "job").returncode == 0
    kin = _cli(db, "nccl", "kineto", "job", "--json")
    assert kin.returncode == 0 and json.loads(kin.stdout)["rows"]["job"] == 30
    fr = _cli(db, "nccl", "ingest", str(shared_data("flight_recorder")), "--run-id", "job")
    assert fr.returncode == 0 and "24 rows" in fr.stdout

    out = _cli(db, "diagnose", "--run-id", "job", "--json")
    assert out.returncode == 3, out.stderr
    report = json.loads(out.stdout)
    assert report["window_ms"] == 100 and report["thresholds"]["comm_share_min"] == 0.85
    assert set(report["shares"]) <= {"comm", "compute", "io", "host", "idle", "unclassified"}
    assert report["stragglers"]["by_rank"][0]["rank"] == 1  # rank 1 was ~96 ms late into one all_reduce
    assert all(fr["ok"] for fr in report["flight_recorder"])
    top = report["top_windows"][0]
    assert top["verdict"] == "comm" and top["evidence"][0]["metric"] == "comm_share"
    assert top["evidence"][0]["value"] > top["evidence"][0]["threshold"] == 0.85
    assert "comm" in report["actions"] and report["breaches"]

    text = _cli(db, "diagnose", "--run-id", "job")
    assert text.returncode == 3
    for needle in ("overall:", "worst windows", "stragglers", "comm_share", "breach:", "Communication-bound"):
        assert needle in text.stdout, text.stdout

    relaxed = _cli(db, "diagnose", "--run-id", "job", "--json",
                   env={"TRISCOPE_STALLS__ALERT_SHARE": "0.9", "TRISCOPE_STALLS__STRAGGLER_ALERT_SECONDS": "1"})
    assert relaxed.returncode == 0 and json.loads(relaxed.stdout)["breaches"] == []

    strag = _cli(db, "nccl", "stragglers", "--run-id", "job")
    assert strag.returncode == 0 and "rank 1" in strag.stdout


def test_since_finds_a_fresh_job(tmp_path: Path) -> None:
    """A real gloo job that just ran is found by ``--since 10m`` and its straggler breaches."""
    out = tmp_path / "job"
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out), str(port), str(r), "2", "0", "0.12", "3"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in (0, 1)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    db = tmp_path / "db"
    ranks = [str(out / "rank0.json"), str(out / "rank1.json")]
    assert _cli(db, "ingest", "trace", *ranks, "--run-id", "fresh").returncode == 0
    assert _cli(db, "nccl", "kineto", "fresh").returncode == 0
    res = _cli(db, "diagnose", "--since", "10m", "--json")
    assert res.returncode == 3, res.stderr
    report = json.loads(res.stdout)
    assert report["stragglers"]["by_rank"][0]["rank"] == 0  # this time rank 0 slept
    units = {u["unit"].split("/")[-1]: u["shares"] for u in report["units"]}
    assert units["cpu-rank1"].get("comm", 0) > units["cpu-rank0"].get("comm", 0)
    # the same range named by its ends: --from (ISO-8601) and --until give the same verdicts
    ends = [datetime.fromtimestamp(time.time() + d, UTC).strftime("%Y-%m-%dT%H:%M:%SZ") for d in (-600, 60)]
    named = _cli(db, "diagnose", "--from", ends[0], "--until", ends[1], "--json")
    assert named.returncode == 3, named.stderr
    assert json.loads(named.stdout)["stragglers"]["by_rank"] == report["stragglers"]["by_rank"]
    assert {u["unit"]: u["shares"] for u in json.loads(named.stdout)["units"]} == \
        {u["unit"]: u["shares"] for u in report["units"]}
    only = _cli(db, "diagnose", "--since", "10m", "--json", "--host", "no-such-host")
    assert only.returncode == 0
    assert json.loads(only.stdout)["units"] == []


def test_empty_range_and_bad_duration(tmp_path: Path) -> None:
    db = tmp_path / "db"
    empty = _cli(db, "diagnose", "--since", "1m")
    assert empty.returncode == 0 and "no GPU samples, traces or IO data" in empty.stdout
    bad = _cli(db, "diagnose", "--since", "soon")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "not a duration" in bad.stderr
    bad_until = _cli(db, "diagnose", "--since", "1m", "--until", "yesterday-ish")
    assert bad_until.returncode == 2 and "--until" in bad_until.stderr
    for argv, needle in ((["--from", "later"], "--from: not a duration or ISO-8601 time"),
                         (["--since", "1m", "--from", "2m"], "either --since or --from"),
                         (["--from", "1m", "--until", "5m"], "empty time range")):
        res = _cli(db, "diagnose", *argv)
        assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and needle in res.stderr, res.stderr


def test_nccl_ingest_reports_bad_files_but_loads_good_ones(tmp_path: Path) -> None:
    db = tmp_path / "db"
    junk = tmp_path / "junk.txt"
    junk.write_text("nothing to see\n")
    res = _cli(db, "nccl", "ingest", str(shared_data("nccl", "inspector_examples.jsonl")), str(junk), "--json")
    assert res.returncode == 1
    body = json.loads(res.stdout)
    assert body["ingested"][0]["rows"] == 2 and "not a recognised" in body["errors"][0]


def _adds_up(rank: dict) -> None:
    """The figures of one rank of a ``--json`` report add up: idle split to idle time, steps to the run."""
    whole = rank["whole"]
    assert whole["host_wait_ns"] + whole["kernel_wait_ns"] + whole["other_idle_ns"] == whole["idle_ns"]
    steps = rank["steps"][:-1] if rank["last_step_dropped"] else rank["steps"]
    for key in ("span_ns", "busy_ns", "compute_ns", "idle_ns", "host_wait_ns", "gpu_events"):
        assert sum(s[key] for s in steps) == whole[key], key


def test_diagnose_a_trace_directory_in_one_command(tmp_path: Path) -> None:
    """``diagnose DIR``: one process ingests both ranks of a job and reports breakdown and stall verdicts; the run
    stays in the store for later commands."""
    db, job = tmp_path / "db", tmp_path / "job42"
    job.mkdir()
    for r in (0, 1):
        sample = shared_data("kineto", f"sampled_128rank_job_rank{r}.json.gz")
        (job / f"rank{r}.json.gz").write_bytes(sample.read_bytes())
    res = _cli(db, "diagnose", str(job), "--json")
    assert res.returncode in (0, 3), res.stderr
    doc = json.loads(res.stdout)
    assert [i["rank"] for i in doc["ingested"]] == [0, 1] and doc["errors"] == []
    (run,) = doc["runs"]
    assert run["run_id"] == "job42" and [r["rank"] for r in run["ranks"]] == [0, 1]
    for rank in run["ranks"]:
        _adds_up(rank)
    assert run["stalls"]["by"] == "step" and run["stalls"]["shares"]
    again = _cli(db, "diagnose", "--trace-run", "job42", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["ranks"] == run["ranks"]


def test_diagnose_a_trace_file_text_and_bad_paths(tmp_path: Path) -> None:
    db = tmp_path / "db"
    text = _cli(db, "diagnose", str(shared_data("kineto", "a100_ddp_2024_rank0.json.gz")))
    assert text.returncode in (0, 3), text.stderr
    for needle in ("whole run", "step 5", "idle split per GPU", "detail, per stream summed over 2 stream(s)",
                   "stall verdicts of run a100_ddp_2024"):
        assert needle in text.stdout, text.stdout
    assert "ingested" in text.stderr and "Traceback" not in text.stderr
    missing = _cli(db, "diagnose", str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0 and "nope.json" in missing.stderr


def test_nccl_output_explains_itself(tmp_path: Path) -> None:
    db = tmp_path / "db"
    empty = _cli(db, "nccl", "stragglers")
    assert empty.returncode == 0 and "nothing to compare: no collectives in the store" in empty.stdout
    trace = shared_data("kineto", "sampled_128rank_job_rank0.json.gz")
    assert _cli(db, "ingest", "trace", str(trace), "--run-id", "old").returncode == 0
    kin = _cli(db, "nccl", "kineto", "old")
    assert kin.returncode == 0 and "old: 10 collective ops on 1 rank" in kin.stdout
    assert "bus bandwidth unknown for 10 of 10 collectives" in kin.stdout and "no message sizes" in kin.stdout
    one = _cli(db, "nccl", "stragglers", "--json")
    assert "nothing cross-rank to compare in run old" in json.loads(one.stdout)["notes"][0]


def _closed_pipe_run(store_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """Run the CLI with stdout on a real pipe whose reader has already gone (``| head`` after it exited)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "TRISCOPE_STORE__PATH": str(store_dir)}
    env.pop("TRISCOPE_CONFIG", None)
    try:
        return subprocess.run([sys.executable, "-m", "triscope", *args], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=REPO, timeout=300)
    finally:
        os.close(write_end)


def test_every_command_exits_quietly_when_its_reader_goes_away(tmp_path: Path) -> None:
    """``triscope ... | head``: a closed pipe ends each command with status 141 and no traceback or pipe error on
    stderr (argparse's own help and version output ignore the closed pipe and exit 0)."""
    db, trace = tmp_path / "db", str(shared_data("kineto", "a100_ddp_2024_rank0.json.gz"))
    res = _closed_pipe_run(db, "--help")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    commands = [  # one of each way a command writes: print/json.dump, rich tables, diagnose's report
        ["ingest", "trace", trace, "--run-id", "r", "--json"],
        ["diagnose", trace],
        ["diagnose", "--trace-run", "r", "--json"],
        ["nccl", "kineto", "r"],
        ["nccl", "stragglers", "--json"],
        ["weights", "show"],
        ["dashboards", "build", "--out", str(tmp_path / "boards")],
    ]
    loud = []
    for args in commands:
        res = _closed_pipe_run(db, *args)
        noise = [w for w in ("Traceback", "BrokenPipe", "Exception ignored", "Errno 32") if w in res.stderr]
        if res.returncode != 141 or noise:
            loud.append(f"{' '.join(args)}: exit {res.returncode}, stderr {res.stderr.strip()[-300:]!r}")
    assert not loud, "\n".join(loud)


def test_json_piped_into_head(tmp_path: Path) -> None:
    """A real ``head -c 100`` on a 4 KiB pipe: the 20 kB report cannot fit, so the command must see the reader
    leave, and exits 141 without a traceback while head gets the start of the JSON."""
    import fcntl

    head = require_binary("head")
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, 1031, 4096)  # F_SETPIPE_SZ
    env = {**os.environ, "TRISCOPE_STORE__PATH": str(tmp_path / "db")}
    env.pop("TRISCOPE_CONFIG", None)
    reader = subprocess.Popen([head, "-c", "100"], stdin=read_end, stdout=subprocess.PIPE)
    writer = subprocess.Popen([sys.executable, "-m", "triscope", "diagnose", "--json",
                               str(shared_data("kineto", "a100_ddp_2024_rank0.json.gz"))],
                              stdout=write_end, stderr=subprocess.PIPE, env=env, cwd=REPO)
    os.close(read_end)
    os.close(write_end)
    first, _ = reader.communicate(timeout=300)
    _, err = writer.communicate(timeout=300)
    assert first.startswith(b"{") and len(first) == 100
    assert writer.returncode == 141 and b"Traceback" not in err and b"BrokenPipe" not in err, err[-2000:]


def test_start_up_imports_only_what_the_command_needs(tmp_path: Path) -> None:
    """CLI start-up stays small: ``--help`` loads none of chDB, numpy, rich, matplotlib; a query on an empty
    store loads chDB's engine only, not its package (timed by bench/cli_e2e.py), and a command configured for a
    server store does not load chDB at all."""
    heavy = ("chdb._chdb", "chdb", "numpy", "rich", "matplotlib", "pyarrow", "pandas")
    probe = ("import sys, contextlib, io\nfrom triscope.cli import main\nout = io.StringIO()\n"
             "try:\n    with contextlib.redirect_stdout(out): main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             f"print(' '.join(m for m in {heavy!r} if m in sys.modules))")
    env = {**os.environ, "TRISCOPE_STORE__PATH": str(tmp_path / "db")}

    def loaded(*args: str, **extra_env: str) -> set[str]:
        res = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True,
                             env={**env, **extra_env}, cwd=REPO, timeout=120)
        assert res.returncode == 0, res.stderr
        return set(res.stdout.split())

    assert loaded("--help") == set()
    assert loaded("diagnose", "--help") == set()
    assert loaded("nccl", "stragglers", "--json") == {"chdb._chdb"}
    # A server store (nothing listens on this port: the command fails with its one-line error) needs no chDB.
    assert "chdb._chdb" not in loaded("nccl", "stragglers", "--json", TRISCOPE_STORE__BACKEND="server",
                                      TRISCOPE_STORE__URL="http://127.0.0.1:9")
    assert loaded("diagnose", "--since", "1m", "--json") & {"rich", "matplotlib", "pyarrow", "pandas"} == set()


def test_a_serving_host_with_only_block_io_says_so_instead_of_unclassified(tmp_path: Path) -> None:
    """A serving fleet without GPU telemetry: the diskstats collector's rows of a calm disk are the stall
    report's only data. It says that in a line, not "unclassified 100%" with a table of one host."""
    db = tmp_path / "db"
    # written by a process of its own: chDB holds a data directory for as long as the process that opened it
    write = ("import sys, time\nfrom triscope.schema import IO_LATENCY, encode_ts, qualified\n"
             "from triscope.store import open_store\n"
             "store = open_store({'store': {'path': sys.argv[1]}})\nnow = time.time_ns()\n"
             "rows = [{'ts': encode_ts(now - s * 10**9), 'host': 'node-1', 'device': 'vda', 'source': 'diskstats',"
             " 'op': op, 'window_seconds': 1.0, 'ios': 30.0, 'p50_seconds': float('nan'),"
             " 'p99_seconds': float('nan'), 'mean_seconds': 0.001, 'queue_depth': 0.4}"
             " for s in range(1, 30) for op in ('read', 'write')]\n"
             "store.insert(qualified(store, IO_LATENCY), IO_LATENCY.columns_of(rows))\nstore.close()\n")
    done = subprocess.run([sys.executable, "-c", write, str(db)], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    res = _cli(db, "diagnose", "--since", "1m")
    assert res.returncode == 0, res.stderr
    assert "no GPU samples or device work in this range" in res.stdout and "none IO- or host-bound" in res.stdout
    assert "unclassified" not in res.stdout
