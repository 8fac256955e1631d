"""End to end as users run it: ``triscope diagnose TRACE_OR_DIR`` vs HolisticTraceAnalysis, one fresh process each.

Timed, wall clock from start to exit of the process (median of ``--repeat`` runs, the two tools interleaved):

- triscope: ``triscope diagnose PATH`` -- ingest into the embedded store, breakdown, per-step stall verdicts, the
  report on stdout (a pipe) -- with a store that exists (not a user's first command) but does not hold the trace.
- HTA: ``python -c SCRIPT`` -- import hta, ``TraceAnalysis(trace_dir=DIR)``, ``get_temporal_breakdown()``, print
  it: the least a user runs to get the same figures (a directory holding just that trace).
- CLI start-up: ``triscope --help``, and ``triscope nccl stragglers --json`` on an empty store.

Both tools run with compiled bytecode (a private ``PYTHONPYCACHEPREFIX``, warmed once untimed), as an installed
package does. CPU seconds (user + sys of the process) are printed too: steadier than wall time on a shared machine.
Targets: under 1 MB no slower than HTA (ratio >= 1), from 25 MB at least 5x, start-up <= 0.3 s.

Usage: python bench/cli_e2e.py [--repeat 3] [--data DIR] [--scales 2,6] [--quick]
``--scales`` builds synthetic traces of N back-to-back copies of the V100 ResNet trace (2: 27 MB, 6: 81 MB of JSON).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from trace_ingest import build_scaled  # bench/ is the script's folder, hence on sys.path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO.parent / "shared" / "data" / "kineto"
TRISCOPE = [sys.executable, "-m", "triscope"]
HTA_SCRIPT = ("import logging, sys\nlogging.disable(logging.WARNING)\nfrom hta.trace_analysis import TraceAnalysis\n"
              "print(TraceAnalysis(trace_dir=sys.argv[1]).get_temporal_breakdown(visualize=False))\n")
FILES = ["triton_single_kernel.json.gz", "alexnet_single_gpu_sync.json.gz", "mtia_inference_rank0.json.gz",
         "a100_ddp_2024_rank0.json.gz", "v100_resnet_ns_resolution_rank0.json.gz"]
JOB = ["sampled_128rank_job_rank0.json.gz", "sampled_128rank_job_rank1.json.gz"]
SMALL_MB, LARGE_MB, LARGE_RATIO, START_UP_S = 1.0, 25.0, 5.0, 0.3


@dataclass
class Timing:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    failed: str = ""

    def median(self) -> float:
        return statistics.median(self.wall) if self.wall else float("nan")

    def run(self, cmd: list[str], env: dict[str, str]) -> None:
        """Run ``cmd`` to completion, stdout on a pipe that is read (as a terminal or ``less`` would)."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
        _, err = proc.communicate()
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)  # grew by this child only: it was reaped just now
        if proc.returncode not in (0, 1, 3):  # diagnose: 1 = some files refused, 3 = a stall threshold breached
            self.failed = (err.decode(errors="replace").strip().splitlines() or [f"exit {proc.returncode}"])[-1][:120]
            return
        self.wall.append(wall)
        self.cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)


def fresh_store(env: dict[str, str], work: Path) -> dict[str, str]:
    """An environment whose embedded store exists (schema created, untimed) and is empty."""
    path = Path(tempfile.mkdtemp(prefix="store-", dir=work))
    store_env = {**env, "TRISCOPE_STORE__PATH": str(path)}
    subprocess.run([*TRISCOPE, "nccl", "stragglers", "--json"], env=store_env, cwd=REPO, check=True,
                   capture_output=True)
    return store_env


def trace_sets(data: Path, work: Path, scales: list[int], quick: bool) -> dict[str, tuple[Path, Path]]:
    """name -> (what triscope is given, the directory HTA is given)."""
    sets: dict[str, tuple[Path, Path]] = {}
    for name in FILES[:2] + FILES[3:4] if quick else FILES:
        folder = work / "hta" / name.split(".")[0]
        folder.mkdir(parents=True)
        shutil.copy(data / name, folder / name)
        sets[name.split(".")[0]] = (folder / name, folder)
    if not quick:
        job = work / "hta" / "sampled_2rank_job"
        job.mkdir()
        for name in JOB:
            shutil.copy(data / name, job / name)
        sets[job.name] = (job, job)
    for n in scales:
        folder = work / "hta" / f"v100_x{n}"
        folder.mkdir()
        path = build_scaled(data / FILES[-1], n, folder / f"v100_x{n}_rank0.json")
        sets[folder.name] = (path, folder)
    return sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--scales", default="2,6", help="synthetic V100 copies, comma-separated ('' for none)")
    parser.add_argument("--quick", action="store_true", help="three small traces only, plus --scales")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cli-e2e-"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "TRISCOPE_CONFIG")}
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    try:
        sets = trace_sets(args.data, work, [int(n) for n in args.scales.split(",") if n], args.quick)
        hta_cmd = [sys.executable, "-c", HTA_SCRIPT]
        # Warm-up, untimed: bytecode compiled, libraries in the page cache.
        first_path, first_dir = next(iter(sets.values()))
        subprocess.run([*TRISCOPE, "diagnose", str(first_path)], env=fresh_store(env, work), cwd=REPO,
                       capture_output=True)
        subprocess.run([*hta_cmd, str(first_dir)], env=env, cwd=REPO, capture_output=True)

        print("CLI start-up (median of 5, target <= 0.3 s):")
        empty = fresh_store(env, work)
        start_up = {"triscope --help": [*TRISCOPE, "--help"],
                    "triscope nccl stragglers --json, empty store": [*TRISCOPE, "nccl", "stragglers", "--json"]}
        for label, cmd in start_up.items():
            t = Timing()
            for _ in range(5):
                t.run(cmd, empty)
            met = "met" if t.median() <= START_UP_S else f"missed by {t.median() - START_UP_S:.2f} s"
            print(f"  {label:<46} {t.median():6.3f} s wall (min {min(t.wall):.3f}), "
                  f"{statistics.median(t.cpu):.3f} s CPU  {met}")

        header = (f"\n{'trace':<28}{'MB':>7}{'triscope s':>12}{'HTA s':>8}{'ratio':>8}{'min ratio':>10}  {'target':<7}"
                  f"{'CPU s triscope/HTA':>19}  verdict")
        print(header)
        print("-" * (len(header) + 20))
        for name, (path, folder) in sets.items():
            size = (sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size) / 1e6
            ours, theirs = Timing(), Timing()
            for _ in range(args.repeat):
                ours.run([*TRISCOPE, "diagnose", str(path)], fresh_store(env, work))
                theirs.run([*hta_cmd, str(folder)], env)
            if ours.failed or theirs.failed:
                print(f"{name:<28}{size:>7.2f}  triscope: {ours.failed or 'ok'} | HTA: {theirs.failed or 'ok'}")
                continue
            ratio = theirs.median() / ours.median()
            need = 1.0 if size < SMALL_MB else LARGE_RATIO if size >= LARGE_MB else None
            verdict = ("-" if need is None else "met" if ratio >= need else
                       f"missed: {ours.median() - theirs.median() / need:.2f} s over {theirs.median() / need:.2f} s")
            target = f">= {need:g}x" if need else "-"
            print(f"{name:<28}{size:>7.2f}{ours.median():>12.3f}{theirs.median():>8.3f}{ratio:>7.1f}x"
                  f"{min(theirs.wall) / min(ours.wall):>9.1f}x  {target:<7}"
                  f"{statistics.median(ours.cpu):>10.2f} / {statistics.median(theirs.cpu):<7.2f}  {verdict}")
            sys.stdout.flush()
        print(f"\nmedians of {args.repeat} runs each, interleaved; ratio = HTA / triscope wall time (min ratio: of the "
              "fastest runs, the least disturbed by other load); MB = the input on disk (.json.gz compressed);\n"
              "CPU s = user + sys, triscope / HTA; 'missed': how much faster triscope would have to be.")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
