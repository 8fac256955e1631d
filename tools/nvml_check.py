#!/usr/bin/env python3
"""Check triscope's NVML sampler on a real GPU machine.

Runs :class:`triscope.collectors.nvml.NvmlSampler` for ``--seconds`` (3 s) at ``--interval`` (0.1 s),
prints for every GPU and metric what it returned (a value range, or why it is NaN), the NVML call
each metric settled on, and the CPU time per sample; then cross-checks memory used against
``nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits`` when nvidia-smi exists.

Exit status: 0 checks passed (or no GPU, printed as one line), 1 a memory mismatch, 2 no GPU with
``--require-gpu``. Usage: ``.venv/bin/python tools/nvml_check.py [--seconds 3] [--require-gpu]``.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import subprocess
import sys
import time
from types import ModuleType
from typing import Any

from triscope.collectors.nvml import NvmlSampler
from triscope.schema import GPU_SAMPLES

MiB = 1 << 20
ID_COLUMNS = {"ts", "host", "gpu", "gpu_uuid", "gpu_model", "source", "state", "pod", "namespace", "container",
              "error", "mig_instance", "mig_profile"}
METRICS = [c for c in GPU_SAMPLES.column_names() if c not in ID_COLUMNS]
RATES = {"pcie_tx_bytes_per_second", "pcie_rx_bytes_per_second", "nvlink_tx_bytes_per_second",
         "nvlink_rx_bytes_per_second", "sm_active_ratio", "sm_occupancy_ratio", "dram_active_ratio"}


def run_sampler(sampler: NvmlSampler, seconds: float) -> tuple[list[dict[str, list[Any]]], float]:
    """Sample for ``seconds`` at the sampler's interval; (gpu_samples batches, CPU seconds per sample)."""
    batches: list[dict[str, list[Any]]] = []
    cpu = 0.0
    deadline = time.monotonic() + seconds
    nxt = time.monotonic()
    while time.monotonic() < deadline:
        t0 = time.process_time()
        out = sampler.collect()
        cpu += time.process_time() - t0
        if GPU_SAMPLES in out:
            batches.append(out[GPU_SAMPLES])
        nxt += sampler.interval_s
        time.sleep(max(0.0, nxt - time.monotonic()))
    return batches, cpu / max(1, len(batches))


def metric_report(batches: list[dict[str, list[Any]]]) -> dict[int, dict[str, tuple[int, int, float, float]]]:
    """Per GPU and metric: (samples, finite samples, min, max) over all batches."""
    acc: dict[int, dict[str, list[float]]] = {}
    for cols in batches:
        for i, gpu in enumerate(cols["gpu"]):
            per = acc.setdefault(int(gpu), {m: [] for m in METRICS})
            for m in METRICS:
                per[m].append(float(cols[m][i]))
    report: dict[int, dict[str, tuple[int, int, float, float]]] = {}
    for gpu, per in acc.items():
        report[gpu] = {}
        for m, vals in per.items():
            finite = [v for v in vals if math.isfinite(v)]
            report[gpu][m] = (len(vals), len(finite), min(finite, default=math.nan), max(finite, default=math.nan))
    return report


def parse_smi_memory(text: str) -> dict[int, float]:
    """``index, memory.used`` CSV lines (with or without a header / ``MiB`` unit) -> MiB per GPU index."""
    out: dict[int, float] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2 or not parts[0].isdigit():
            continue  # header or noise
        value = parts[1].removesuffix("MiB").strip()
        try:
            out[int(parts[0])] = float(value)
        except ValueError:
            continue  # "[N/A]"
    return out


def smi_memory_used() -> dict[int, float] | None:
    """nvidia-smi's memory.used (MiB) per GPU index, or None when nvidia-smi is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        res = subprocess.run([exe, "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_smi_memory(res.stdout) if res.returncode == 0 else None


def compare_memory(nvml: dict[int, tuple[float, float]], before: dict[int, float], after: dict[int, float],
                   tolerance_mib: float = 64.0) -> list[str]:
    """Mismatches between NVML (used, reserved bytes) and nvidia-smi readings taken before and after.

    nvidia-smi reports used without the driver-reserved part on current drivers and with it on old
    ones, so either matches; the NVML reading must fall between the two nvidia-smi readings
    (widened by ``tolerance_mib``) to allow for allocations in between."""
    problems: list[str] = []
    for gpu, (used, reserved) in sorted(nvml.items()):
        if gpu not in before or gpu not in after:
            problems.append(f"GPU {gpu}: nvidia-smi did not report it")
            continue
        lo, hi = min(before[gpu], after[gpu]) - tolerance_mib, max(before[gpu], after[gpu]) + tolerance_mib
        candidates = [used / MiB]
        if math.isfinite(reserved):
            candidates.append((used + reserved) / MiB)
        if not any(math.isfinite(c) and lo <= c <= hi for c in candidates):
            problems.append(f"GPU {gpu}: NVML memory used {used / MiB:.0f} MiB (reserved {reserved / MiB:.0f} MiB) "
                            f"vs nvidia-smi {before[gpu]:.0f}..{after[gpu]:.0f} MiB")
    return problems


def _api_line(sampler: NvmlSampler, index: int) -> str:
    dev = next((d for d in sampler.devices if d.index == index), None)
    if dev is None:
        return ""
    parts = []
    for key, options in dev.getters.items():
        if not options:
            parts.append(f"{key}=unsupported")
            continue
        if key == "power" and "power_mw" in dev.field_keys:
            parts.append("power=FieldValues(POWER_INSTANT)")
            continue
        fn, args = options[0]
        suffix = "(v2)" if key == "memory" and len(args) > 1 else ""
        parts.append(f"{key}={getattr(fn, '__name__', '?').removeprefix('nvmlDevice')}{suffix}")
    parts.append(f"fields={','.join(dev.field_keys) or 'none'}")
    parts.append(f"gpm={'yes' if dev.gpm is not None else 'no'}")
    return "  NVML calls: " + " ".join(parts)


def main(argv: list[str] | None = None, nvml: ModuleType | None = None) -> int:
    """Run the check; see the module docstring for the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--tolerance-mib", type=float, default=64.0)
    ap.add_argument("--require-gpu", action="store_true", help="exit 2 instead of 0 when there is no GPU")
    args = ap.parse_args(argv)
    sampler = NvmlSampler({"nvml": {"interval_s": args.interval, "retry_s": 3600}}, nvml=nvml)
    nvml_log = logging.getLogger("triscope.collectors.nvml")
    level = nvml_log.level
    nvml_log.setLevel(logging.ERROR)  # the "no GPU" outcome is printed below as one line
    try:
        sampler.start()
    finally:
        nvml_log.setLevel(level)
    try:
        if not sampler.devices:
            print(f"no GPU: NVML state {sampler.state}: {sampler.reason}")
            return 2 if args.require_gpu else 0
        print(f"NVML: {len(sampler.devices)} GPU(s), state {sampler.state}; sampling {args.seconds:g} s "
              f"every {args.interval:g} s")
        batches, cpu_per_sample = run_sampler(sampler, args.seconds)
        report = metric_report(batches)
        models = {d.index: (d.model, d.uuid) for d in sampler.devices}
        for gpu, metrics in sorted(report.items()):
            model, uuid = models.get(gpu, ("?", "?"))
            print(f"GPU {gpu} {model} {uuid}")
            print(_api_line(sampler, gpu))
            for m, (n, finite, lo, hi) in metrics.items():
                if finite == 0:
                    why = "NaN in every sample (unsupported here)" if m not in RATES or n > 2 else "no baseline yet"
                    if m == "l2_bandwidth_ratio":
                        why = "NaN (NVML has no L2 bandwidth; DCGM only)"
                    print(f"  {m:30s} unsupported  {why}")
                else:
                    rng = f"{lo:.6g}" if lo == hi else f"{lo:.6g} .. {hi:.6g}"
                    print(f"  {m:30s} supported    {rng}  ({finite}/{n} samples)")
        states = sorted({s for b in batches for s in b["state"]})
        print(f"sample states: {', '.join(states)}; {len(batches)} samples; "
              f"CPU {cpu_per_sample * 1e3:.3f} ms per sample ({cpu_per_sample * 1e3 / len(sampler.devices):.3f} "
              "ms per GPU)")
        before = smi_memory_used()
        if before is None:
            print("nvidia-smi not available: memory cross-check skipped")
            return 0
        last = sampler.sample_once()[GPU_SAMPLES]
        after = smi_memory_used() or {}
        nvml_mem = {int(g): (float(u), float(r)) for g, u, r, st in
                    zip(last["gpu"], last["memory_used_bytes"], last["memory_reserved_bytes"], last["state"],
                        strict=True) if st == "ok"}
        problems = compare_memory(nvml_mem, before, after, args.tolerance_mib)
        for gpu, (used, reserved) in sorted(nvml_mem.items()):
            print(f"memory GPU {gpu}: NVML used {used / MiB:.0f} MiB reserved {reserved / MiB:.0f} MiB; "
                  f"nvidia-smi {before.get(gpu, math.nan):.0f} / {after.get(gpu, math.nan):.0f} MiB")
        for p in problems:
            print(f"MISMATCH {p}")
        print("memory cross-check: " + ("FAILED" if problems else "ok"))
        return 1 if problems else 0
    finally:
        sampler.close()


if __name__ == "__main__":
    sys.exit(main())
