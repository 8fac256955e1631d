"""Trace ingest + breakdown: triscope vs HolisticTraceAnalysis on the same traces, in one run.

Each tool runs in its own fresh subprocess per trace set, so peak RSS is measured cleanly
(``ru_maxrss`` of that process) and imports are excluded from the timed part:

- triscope: open the embedded store, then time ``ingest_paths`` + ``analyze_run``.
- HTA: time ``TraceAnalysis(trace_dir=...)`` (parse) + ``get_temporal_breakdown``.

Figures are compared against HTA run with ``HTA_DISABLE_NS_ROUNDING=1``: by default HTA
rounds every event of a float-timestamp trace inward to whole microseconds (ts up, end down;
a workaround for pytorch/pytorch#122425), which shortens every kernel by up to 2 us and
inflates idle time; that default is printed too, to show the gap.

Usage: python bench/trace_ingest.py [--scale N] [--ranks N] [--data DIR]
``--scale N`` also builds a synthetic trace of N copies of the V100 ResNet trace (shifted in
time) to show how both tools grow with size (N=70 gives about 1 GB of JSON); ``--ranks N``
(default 16) a job directory of N small ranks, copies of the 2-rank sample re-ranked, to show
how both grow with the rank count.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO.parent / "shared" / "data" / "kineto"
SETS = {
    "v100_resnet": ["v100_resnet_ns_resolution_rank0.json.gz"],
    "a100_ddp": ["a100_ddp_2024_rank0.json.gz"],
    "sampled_2rank": ["sampled_128rank_job_rank0.json.gz", "sampled_128rank_job_rank1.json.gz"],
}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class AnonPeak:
    """Peak anonymous (private, non file-backed) RSS of this process, sampled every 2 ms.

    Peak RSS counts the pages of mapped libraries too: chDB's shared library alone brings
    ~270-330 MB of file-backed, shared, reclaimable pages before any trace is read. RssAnon is the
    memory a tool really allocates for the work (heap, parsed columns, DataFrames).
    """

    def __init__(self) -> None:
        import threading

        self.peak_kb = self._now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _now() -> int:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
        return 0

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak_kb = max(self.peak_kb, self._now())

    def stop_mb(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak_kb, self._now()) / 1024


def worker_triscope(folder: Path) -> dict:
    from triscope.analyzers.trace_breakdown import analyze_run
    from triscope.collectors.kineto import ingest_paths
    from triscope.store import open_store

    store_dir = tempfile.mkdtemp(prefix="bench-store-")
    store = open_store({"store": {"path": store_dir}})
    store.query("SELECT 1")
    import pyarrow  # noqa: F401 - imported before timing starts
    base = _rss_mb()
    anon = AnonPeak()
    start = time.perf_counter()
    ingest_paths(store, [folder], run_id="bench")
    ranks = analyze_run(store, "bench")
    seconds = time.perf_counter() - start
    out = {"seconds": seconds, "peak_rss_mb": _rss_mb(), "baseline_rss_mb": base, "peak_anon_mb": anon.stop_mb(),
           "ranks": {r.rank: {"idle": r.whole.idle_ns / 1e3, "compute": r.whole.compute_ns / 1e3,
                              "non_compute": r.whole.non_compute_ns / 1e3, "span": r.whole.span_ns / 1e3}
                     for r in ranks}}
    store.close()
    shutil.rmtree(store_dir, ignore_errors=True)
    return out


def worker_hta(folder: Path) -> dict:
    import logging

    logging.disable(logging.WARNING)
    from hta.trace_analysis import TraceAnalysis

    base = _rss_mb()
    anon = AnonPeak()
    start = time.perf_counter()
    analysis = TraceAnalysis(trace_dir=str(folder))
    table = analysis.get_temporal_breakdown(visualize=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_rss_mb": _rss_mb(), "baseline_rss_mb": base, "peak_anon_mb": anon.stop_mb(),
            "ranks": {int(row["rank"]): {"idle": float(row["idle_time(us)"]), "compute": float(row["compute_time(us)"]),
                                         "non_compute": float(row["non_compute_time(us)"]),
                                         "span": float(row["kernel_time(us)"])}
                      for _, row in table.iterrows()}}


def run_worker(tool: str, folder: Path, exact_hta: bool = True) -> dict:
    env = {**os.environ}
    if tool == "hta" and exact_hta:
        env["HTA_DISABLE_NS_ROUNDING"] = "1"
    proc = subprocess.run([sys.executable, __file__, "--worker", tool, str(folder)], capture_output=True,
                          text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{tool} worker failed on {folder}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build_scaled(source: Path, copies: int, out: Path) -> Path:
    """A trace of ``copies`` back-to-back copies of ``source``'s events (written like Kineto)."""
    doc = json.loads(gzip.decompress(source.read_bytes()))
    events = doc.pop("traceEvents")
    ts = [float(e["ts"]) for e in events if "ts" in e]
    period = max(float(e["ts"]) + float(e.get("dur", 0)) for e in events if "ts" in e) - min(ts) + 1000.0
    with out.open("w") as fh:
        fh.write('{\n  "schemaVersion": 1,\n  "traceEvents": [\n')
        first = True
        for copy in range(copies):
            for e in events:
                e2 = dict(e)
                if "ts" in e2:
                    e2["ts"] = round(float(e2["ts"]) + copy * period, 3)
                if "args" in e2 and isinstance(e2["args"], dict):
                    args = dict(e2["args"])
                    for key in ("correlation", "External id"):
                        if isinstance(args.get(key), int):
                            args[key] = args[key] + copy * 10_000_000
                    e2["args"] = args
                fh.write(("" if first else ",\n") + "  " + json.dumps(e2))
                first = False
        fh.write('\n  ],\n  "distributedInfo": {"rank": 0}\n}\n')
    return out


def build_ranks(sources: list[Path], ranks: int, out: Path) -> Path:
    """A job directory of ``ranks`` rank files, rank k a copy of ``sources[k % len(sources)]``
    with ``distributedInfo.rank = k`` (a many-rank job of small ranks)."""
    docs = [json.loads(gzip.decompress(src.read_bytes())) for src in sources]
    for k in range(ranks):
        doc = docs[k % len(docs)]
        doc.setdefault("distributedInfo", {})["rank"] = k
        (out / f"job_rank{k}.json.gz").write_bytes(gzip.compress(json.dumps(doc).encode(), compresslevel=6))
    return out


def agreement(ours: dict, theirs: dict) -> float:
    """Largest relative difference over ranks and figures (percent)."""
    worst = 0.0
    for rank, figures in theirs["ranks"].items():
        mine = ours["ranks"][str(rank)] if str(rank) in ours["ranks"] else ours["ranks"][rank]
        for key, value in figures.items():
            if value:
                worst = max(worst, abs(mine[key] - value) / abs(value) * 100)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--scale", type=int, default=10, help="copies of the V100 trace in the synthetic set (0: none)")
    parser.add_argument("--ranks", type=int, default=16,
                        help="ranks of the synthetic many-rank job built from the 2-rank sample (0: none)")
    parser.add_argument("--worker", nargs=2, metavar=("TOOL", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        tool, folder = args.worker
        result = worker_triscope(Path(folder)) if tool == "triscope" else worker_hta(Path(folder))
        print(json.dumps(result))
        return

    work = Path(tempfile.mkdtemp(prefix="bench-traces-"))
    sets: dict[str, Path] = {}
    for name, files in SETS.items():
        folder = work / name
        folder.mkdir()
        for f in files:
            shutil.copy(args.data / f, folder / f)
        sets[name] = folder
    if args.scale:
        folder = work / f"v100_x{args.scale}"
        folder.mkdir()
        build_scaled(args.data / SETS["v100_resnet"][0], args.scale, folder / "scaled_rank0.json")
        sets[folder.name] = folder
    if args.ranks:
        folder = work / f"sampled_{args.ranks}rank"
        folder.mkdir()
        build_ranks([args.data / f for f in SETS["sampled_2rank"]], args.ranks, folder)
        sets[folder.name] = folder

    header = (f"{'trace set':<16}{'size MB':>9}{'triscope s':>12}{'HTA s':>9}{'speed-up':>10}"
              f"{'triscope MB':>13}{'HTA MB':>9}{'mem ratio':>11}{'anon MB':>14}{'anon ratio':>12}"
              f"{'max diff %':>12}{'HTA-default idle diff %':>25}")
    print(header)
    print("-" * len(header))
    for name, folder in sets.items():
        size = sum(f.stat().st_size for f in folder.iterdir()) / 1e6
        ours = run_worker("triscope", folder)
        hta = run_worker("hta", folder, exact_hta=True)
        hta_default = run_worker("hta", folder, exact_hta=False)
        rank0 = next(iter(hta_default["ranks"]))
        mine0 = ours["ranks"].get(str(rank0), ours["ranks"].get(rank0))
        idle_gap = (abs(hta_default["ranks"][rank0]["idle"] - mine0["idle"]) / mine0["idle"] * 100
                    if mine0 and mine0["idle"] else 0.0)
        print(f"{name:<16}{size:>9.1f}{ours['seconds']:>12.3f}{hta['seconds']:>9.3f}"
              f"{hta['seconds'] / ours['seconds']:>9.1f}x{ours['peak_rss_mb']:>13.0f}{hta['peak_rss_mb']:>9.0f}"
              f"{ours['peak_rss_mb'] / hta['peak_rss_mb']:>11.2f}"
              f"{ours['peak_anon_mb']:>7.0f}/{hta['peak_anon_mb']:<6.0f}"
              f"{ours['peak_anon_mb'] / hta['peak_anon_mb']:>12.2f}"
              f"{agreement(ours, hta):>12.3f}{idle_gap:>25.1f}")
        sys.stdout.flush()
    print("\nspeed-up = HTA time / triscope time (ingest into the embedded store + breakdown vs parse + "
          "get_temporal_breakdown); mem ratio = triscope peak RSS / HTA peak RSS (whole process, mapped\n"
          "library pages included); anon = peak anonymous RSS, triscope/HTA (memory allocated for the work);\n"
          "max diff = largest relative difference of idle/compute/non-compute/span vs HTA with exact timestamps;\n"
          "HTA-default idle diff = how far HTA's default (rounded) idle time is from the exact figure.")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
