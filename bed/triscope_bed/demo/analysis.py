"""What the demo fleet left in the store: rows per backend, the heatmap, the weight engine replayed."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from triscope.schema import GPU_SAMPLES, REQUESTS, SERVING_METRICS, qualified
from triscope.store import Store

_WINDOW = "ts >= fromUnixTimestamp64Nano({t0:Int64}) AND ts < fromUnixTimestamp64Nano({t1:Int64})"


def backend_counts(store: Store, rows: list[dict[str, Any]], t0_ns: int, end_ns: int, source: str
                   ) -> list[dict[str, Any]]:
    """``rows`` (one per backend: name, address, host, what was sent) with what the store holds for it."""
    p = {"t0": t0_ns, "t1": end_ns + 1, "names": [r["address"] for r in rows]}
    spans = dict(store.query(
        f"SELECT backend, count() FROM {qualified(store, REQUESTS)} WHERE {_WINDOW} "
        "AND backend IN {names:Array(String)} GROUP BY backend", p).rows)
    p99 = dict(store.query(
        f"SELECT backend, quantileExact(0.99)(latency_seconds) FROM {qualified(store, REQUESTS)} "
        f"WHERE {_WINDOW} AND backend IN {{names:Array(String)}} AND status = 'ok' GROUP BY backend", p).rows)
    scrapes = dict(store.query(
        f"SELECT backend, count() FROM {qualified(store, SERVING_METRICS)} WHERE {_WINDOW} "
        "AND backend IN {names:Array(String)} GROUP BY backend", p).rows)
    gpu = dict(store.query(
        f"SELECT host, count() FROM {qualified(store, GPU_SAMPLES)} WHERE {_WINDOW} AND source = {{src:String}} "
        "GROUP BY host", {**p, "src": source}).rows)
    return [{**r, "spans_stored": int(spans.get(r["address"], 0)), "p99_latency_seconds": _num(p99.get(r["address"])),
             "serving_metrics_rows": int(scrapes.get(r["address"], 0)), "gpu_samples_rows": int(gpu.get(r["host"], 0))}
            for r in rows]


def heatmap_doc(store: Store, config: dict[str, Any], names: list[str], t0_ns: int, end_ns: int,
                png: Path | None) -> tuple[dict[str, Any], Any]:
    """The heatmap of the load window (PNG too when asked): its JSON summary and the result."""
    from triscope.analyzers.heatmap import HeatmapSpec, compute_heatmap

    result = compute_heatmap(store, HeatmapSpec.from_config(config), t0_ns, end_ns + 1, backends=names)
    doc = {"requests": result.requests, "unmatched_requests": result.unmatched,
           "tensor_sum": int(result.tensor.sum()), "shape": list(result.tensor.shape),
           "nonzero_cells": int((result.tensor > 0).sum()),
           "latency_marginal": result.tensor.sum(axis=(0, 1)).tolist(), "patterns": result.patterns,
           "seconds": result.seconds, "png": None}
    if png is not None and result.requests:
        from triscope.commands.heatmap import write_png

        png.parent.mkdir(parents=True, exist_ok=True)
        write_png(result, str(png), None)
        doc["png"] = str(png)
    return doc, result


def replay_weights(store: Store, config: dict[str, Any], backends: list[dict[str, Any]], t0_ns: int,
                   load_end_ns: int) -> dict[str, Any]:
    """Replay the engine every ``interval_s`` over the stored rows (inputs as of each instant), as the
    live feed would have run; ``backends`` are dicts with name, address and host."""
    from triscope.analyzers.routing import BackendConfig, WeightParams, compute_weights, read_inputs, with_address

    params = WeightParams.from_config(config)
    params = dataclasses.replace(params, discover=False, history=False, backends={
        b["address"]: BackendConfig(b["address"], b["host"], (0,), b["address"]) for b in backends})
    start, end = t0_ns / 1e9, load_end_ns / 1e9
    steps = max(1, int((end - start) / params.interval_s))
    times = [start + params.interval_s * (i + 1) for i in range(steps)]
    if end - times[-1] > 1e-3:
        times.append(end)
    state = None
    timeline: list[dict[str, Any]] = []
    result = None
    for now in times:
        inputs = [with_address(i, params) for i in read_inputs(store, params, now)]
        result, state = compute_weights(inputs, state, params, now)
        weights = {n: {"weight": w.weight, "drained": w.state == "drain"} for n, w in result.backends.items()}
        timeline.append({"t_s": round(now - start, 3), "stale": result.stale, **weights})
    assert result is not None
    doc = result.to_dict()
    by_addr = {b["address"]: b["name"] for b in backends}
    for addr, entry in doc["backends"].items():
        entry["name"] = by_addr.get(addr, addr)
        seen = [t[addr] for t in timeline if addr in t]
        entry["min_weight"] = min(s["weight"] for s in seen) if seen else None
        entry["drained_updates"] = sum(1 for s in seen if s["drained"])
    doc["updates"] = len(timeline)
    doc["timeline"] = timeline
    return doc


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
