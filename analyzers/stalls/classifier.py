"""``diagnose_stalls``: gather each GPU / rank's data in a range, measure every window, classify it."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

from triscope.analyzers.nccl_crossrank import flight_recorder_check, stragglers
from triscope.analyzers.stalls import readers
from triscope.analyzers.stalls.config import HOST_IO_DEVICE, stall_config
from triscope.analyzers.stalls.metrics import Unit, unit_windows, window_metrics
from triscope.analyzers.stalls.report import StallReport, Window
from triscope.analyzers.stalls.rules import LazyEvidence, classify_windows
from triscope.errors import InputError
from triscope.store.base import Store


def parse_duration(text: str) -> float:
    """Seconds in ``90s``, ``10m``, ``2h``, ``1d`` or a bare number of seconds."""
    units = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    t = text.strip().lower()
    for suffix in ("ms", "s", "m", "h", "d"):
        if t.endswith(suffix):
            number, scale = t[: -len(suffix)], units[suffix]
            break
    else:
        number, scale = t, 1.0
    try:
        value = float(number) * scale
    except ValueError:
        raise InputError(f"not a duration: {text!r} (use e.g. 30s, 10m, 2h)") from None
    if value <= 0 or not math.isfinite(value):
        raise InputError(f"duration must be positive: {text!r}")
    return value


class _Units(dict[tuple[str, str], Unit]):
    """Units by (host, device), created on first use. A device is named by its type and index
    (``gpu0``, ``mtia17``); a rank with no device work is ``cpu-rankN`` (no device data)."""

    def get_unit(self, host: str, gpu: int, rank: int | None = None, device_type: str = "gpu",
                 has_device: bool = True) -> Unit:
        if not has_device:
            device = f"cpu-rank{rank}"
        else:
            device = f"{device_type}{gpu}" if gpu >= 0 else f"{device_type}-rank{rank}"
        if (host, device) not in self:
            self[(host, device)] = Unit(host, device, gpu if has_device else -1, device_data=has_device)
        return self[(host, device)]


def _gather(store: Store, start_ns: int, end_ns: int, max_events: int, host_set: set[str], gpu_set: set[int],
            model: str | None, run_ids: list[str] | None,
            parts: list[dict[str, Any]] | None = None) -> tuple[_Units, bool]:
    """Units with their samples and trace intervals; whether a model filter applies."""
    units = _Units()
    model_gpus = readers.model_gpus(store, model, start_ns, end_ns) if model else None
    cols = readers.samples(store, start_ns, end_ns)
    hosts_col, gpus_col = cols["host"], np.asarray(cols["gpu_index"], dtype=np.int64)
    n = len(gpus_col)
    keep = np.ones(n, dtype=bool)
    if model_gpus is not None and n:
        wanted = str(model).lower()
        models, model_index = np.unique(cols["gpu_model"].astype(str), return_inverse=True)
        keep = np.array([wanted in m.lower() for m in models], dtype=bool)[model_index.reshape(-1)]
    values = np.column_stack([np.asarray(cols[k], dtype=np.float64) for k in ("sm", "dram", "l2", "util")]) \
        if n else np.zeros((0, 4))
    ts_col = np.asarray(cols["ts_ns"], dtype=np.int64)
    # rows come sorted by (host, gpu): one unit per run of equal keys
    cuts = [0, *(np.flatnonzero((hosts_col[1:] != hosts_col[:-1]) | (gpus_col[1:] != gpus_col[:-1])) + 1).tolist(), n]
    for a, b in zip(cuts, cuts[1:], strict=False):
        if b <= a:
            continue
        host, gpu = str(hosts_col[a]), int(gpus_col[a])
        rows = slice(a, b)
        if model_gpus is not None and ((host, str(gpu)) in model_gpus or (host, "") in model_gpus):
            picked = np.ones(b - a, dtype=bool)
        else:
            picked = keep[rows]
        if not picked.any():
            continue
        unit = units.get_unit(host, gpu)  # one run of rows per (host, gpu): its samples, whole
        unit.sample_ts, unit.sample_values = ts_col[rows][picked], values[rows][picked]
    if parts is None:
        parts = readers.trace_parts(store, start_ns, end_ns, run_ids)
    for part in parts:
        if host_set and part["host"] not in host_set:
            continue
        if gpu_set and part["device"] not in gpu_set:
            continue
        if model_gpus is not None and not ({(part["host"], str(part["device"])), (part["host"], "")} & model_gpus):
            continue
        part["iv"] = readers.trace_intervals(store, part, start_ns, end_ns, max_events)
        u = units.get_unit(part["host"], part["device"], part["rank"], part["device_type"], part["has_device"])
        u.traces.append(part)
        u.ranks.add(part["rank"])
        u.runs.add(part["run_id"])
    return units, model_gpus is not None


def diagnose_stalls(store: Store, start_ns: int, end_ns: int, config: dict[str, Any],
                    hosts: Iterable[str] | None = None, gpus: Iterable[int] | None = None,
                    model: str | None = None, run_ids: list[str] | None = None, by: str = "window",
                    trace_parts: list[dict[str, Any]] | None = None) -> StallReport:
    """Classify every window (or profiler step) of every GPU/rank with data in [start_ns, end_ns).

    ``trace_parts``: ``readers.trace_parts`` of this range and these runs when the caller has them."""
    cfg = stall_config(config)
    if end_ns <= start_ns:
        raise InputError("the time range is empty (--until is before --since)")
    w_ns = int(round(cfg.window_ms * 1e6))
    host_set = set(hosts or [])
    gpu_set = {int(g) for g in gpus or []}
    units, by_model = _gather(store, start_ns, end_ns, cfg.max_trace_events, host_set, gpu_set, model, run_ids,
                              trace_parts)
    io_by_host: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for row in readers.io_rows(store, start_ns, end_ns):
        io_by_host[row[0]].append(row)
    queue_by_host: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for host, ts, q in readers.serving_queue(store, start_ns, end_ns):
        queue_by_host[host].append((int(ts), float(q)))
    if not run_ids:
        for host in io_by_host:  # a host with block-IO data but no GPU data still gets its IO verdicts
            if not any(u.host == host for u in units.values()) and (not gpu_set and not by_model):
                u = Unit(host, HOST_IO_DEVICE, -1, device_data=False)
                u.sample_ts = np.array(sorted(int((r[3] + r[4]) // 2) for r in io_by_host[host]), dtype=np.int64)
                u.sample_values = np.full((len(u.sample_ts), 4), np.nan)
                units[(host, HOST_IO_DEVICE)] = u
    report = StallReport(start_ns, end_ns, float(cfg.window_ms), by, cfg)
    for (host, _device), unit in sorted(units.items()):
        if host_set and host not in host_set:
            continue
        if gpu_set and unit.gpu not in gpu_set:
            continue
        intervals = unit_windows(unit, start_ns, end_ns, w_ns, by)
        if not intervals:
            continue
        metrics, columns = window_metrics(unit, intervals, io_by_host.get(host, []), queue_by_host.get(host, []),
                                          cfg)
        verdicts, matched, severity = classify_windows(columns, cfg)
        report.windows.extend(
            Window(unit.key, host, unit.device, a, b, kind, label, m, verdict, also, LazyEvidence(m, cfg), sev,
                   device_data=unit.device_data)
            for (a, b, kind, label), m, verdict, also, sev in zip(intervals, metrics, verdicts, matched,
                                                                   severity.tolist(), strict=True))
    traced_runs = sorted({r for u in units.values() for r in u.runs}) or run_ids
    strag = stragglers(store, run_ids=traced_runs, start_ns=None if run_ids else start_ns,
                       end_ns=None if run_ids else end_ns, min_lateness_seconds=cfg.straggler_min_lateness_seconds,
                       hosts=sorted(host_set) or None)
    report.stragglers = strag.to_json()
    report.flight_recorder = flight_recorder_check(store, run_ids, None if run_ids else start_ns,
                                                   None if run_ids else end_ns)
    return report


def diagnose_runs(store: Store, run_ids: list[str], config: dict[str, Any], by: str = "step",
                  ranks: Iterable[int] | None = None) -> StallReport:
    """Verdicts over the whole recorded span of the given trace runs (their extents read once); ``ranks``:
    only these ranks."""
    parts = readers.trace_parts(store, -(2**62), 2**62, run_ids)
    if ranks is not None:
        keep = set(ranks)
        parts = [p for p in parts if p["rank"] in keep]
    start_ns, end_ns = readers.span_of(parts, run_ids)
    return diagnose_stalls(store, start_ns, end_ns + 1, config, run_ids=run_ids, by=by, trace_parts=parts)
