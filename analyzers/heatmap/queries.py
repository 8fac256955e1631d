"""The heatmap's SQL: requests binned by their backend's QPS, GPU memory and latency, all in ClickHouse.

How windows, GPU slots and the memory ASOF join work is described in docs/heatmap.md.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from triscope.analyzers.heatmap.config import HeatmapSpec
from triscope.analyzers.heatmap.result import HeatmapResult, pattern
from triscope.errors import InputError
from triscope.schema import GPU_SAMPLES, REQUESTS, qualified
from triscope.store import Store


def _filters(backends: list[str] | None, models: list[str] | None) -> tuple[str, str, dict[str, Any]]:
    where, selected, params = "", "1", {}
    if backends:
        where = " AND backend IN {backends:Array(String)}"
        params["backends"] = list(backends)
    if models:
        selected = "model IN {models:Array(String)}"
        params["models"] = list(models)
    return where, selected, params


_HOST_WIDE = 0x10000  # GPU slot meaning "all GPUs of the host" (requests with an empty gpu)


_PER_GPU_MEM = "\n    SELECT slot, w, used FROM per_gpu"
# Host-wide slots (requests with an empty gpu): in every window where any GPU of the host reported,
# the sum over the host's GPUs of each one's latest window mean at most max_age_w windows old.
_HOST_MEM = f"""
    SELECT slot, w, used FROM per_gpu
    UNION ALL
    SELECT x.hslot AS hs, x.w AS hw, sumIf(g.used, g.w > 0 AND x.w - g.w <= {{max_age_w:Int64}})
    FROM (SELECT hosts_w.hslot AS hslot, hosts_w.w AS w, host_gpus.gslot AS gslot
          FROM (SELECT DISTINCT bitOr(bitAnd(slot, bitNot(toUInt64(0x1FFFF))), {_HOST_WIDE}) AS hslot, w
                FROM per_gpu) AS hosts_w
          INNER JOIN (SELECT DISTINCT bitOr(bitAnd(slot, bitNot(toUInt64(0x1FFFF))), {_HOST_WIDE}) AS hslot,
                             slot AS gslot FROM per_gpu) AS host_gpus ON hosts_w.hslot = host_gpus.hslot) AS x
    ASOF LEFT JOIN per_gpu AS g ON x.gslot = g.slot AND x.w >= g.w
    GROUP BY hs, hw"""


def _windows_sql(store: Store, backend_where: str, payload: str, payload_cols: str, host_wide: bool = True) -> str:
    """CTEs: per backend window (``k`` = window << 16 | backend number) the request count, the GPU
    slot (``host number << 17 | GPU index``, from one row's host and gpu) and ``payload`` arrays,
    ASOF-joined on the slot with that GPU's (or host's) memory in the latest sampled window
    (``joined``). Host-wide memory rows are only built when ``host_wide`` (some request has an
    empty ``gpu``)."""
    req, gpu = qualified(store, REQUESTS), qualified(store, GPU_SAMPLES)
    mem_sql = _HOST_MEM if host_wide else _PER_GPU_MEM
    return f"""
WITH
  wins AS (
    SELECT bitOr(bitShiftLeft(toUInt64(intDiv(toUnixTimestamp64Nano(ts), {{wns:Int64}})), 16),
                 transform(toString(backend), {{bl:Array(String)}}, {{bid:Array(UInt16)}}, toUInt16(0))) AS k,
           toInt64(bitShiftRight(k, 16)) AS w,
           any(bitOr(bitShiftLeft(toUInt64(transform(toString(host), {{hosts:Array(String)}}, {{hid:Array(UInt32)}},
                                                     toUInt32(0))), 17),
                     toUInt64(multiIf(gpu = '', {_HOST_WIDE}, match(gpu, '^[0-9]+$'), toUInt32OrZero(toString(gpu)),
                                      transform(toString(gpu), {{uuids:Array(String)}}, {{uuid_idx:Array(UInt32)}},
                                                toUInt32(65535)))))) AS slot,
           count() AS n, {payload}
    FROM {req}
    WHERE ts >= fromUnixTimestamp64Nano({{t0:Int64}}) AND ts < fromUnixTimestamp64Nano({{t1:Int64}}){backend_where}
    GROUP BY k
  ),
  per_gpu AS (
    SELECT bitOr(bitShiftLeft(toUInt64(transform(toString(host), {{hosts:Array(String)}}, {{hid:Array(UInt32)}},
                                                 toUInt32(0))), 17), toUInt64(gpu)) AS slot,
           intDiv(toUnixTimestamp64Nano(ts), {{wns:Int64}}) AS w, avg(memory_used_bytes) AS used
    FROM {gpu}
    WHERE ts >= fromUnixTimestamp64Nano({{m0:Int64}}) AND ts < fromUnixTimestamp64Nano({{t1:Int64}})
      AND isFinite(memory_used_bytes)
    GROUP BY slot, w
  ),
  mem AS ({mem_sql}
  ),
  joined AS (
    SELECT slots.n AS n, {payload_cols}, mem.used AS used,
           mem.w > 0 AND slots.w - mem.w <= {{max_age_w:Int64}} AS matched,
           least(toUInt32(floor(slots.n * 1e9 / {{wns:Int64}} / {{qps_bin:Float64}})), {{qn:UInt32}} - 1) AS qbin,
           least(toUInt32(floor(greatest(mem.used, 0) / {{mem_bin:Float64}})), {{mn:UInt32}} - 1) AS mbin
    FROM wins AS slots ASOF LEFT JOIN mem ON slots.slot = mem.slot AND slots.w >= mem.w
  )
"""


def _resolve(store: Store, backends: list[str] | None) -> dict[str, Any]:
    """Numbers for backends and hosts, and GPU uuid -> index, as query parameters.

    Taken over the whole tables (a superset of the range is enough and far cheaper to list)."""
    req = qualified(store, REQUESTS)
    names = [r[0] for r in store.query(f"SELECT DISTINCT backend FROM {req}").rows]
    host_wide = bool(store.query(f"SELECT count() FROM (SELECT DISTINCT gpu FROM {req}) WHERE gpu = ''").scalar())
    if backends:
        names = [b for b in names if b in set(backends)]
    if len(names) >= 65535:
        raise InputError(f"{len(names)} backends; the heatmap handles at most 65534 at once (use --backend)")
    gpus = store.query(f"SELECT host, gpu, any(gpu_uuid) FROM {qualified(store, GPU_SAMPLES)} "
                       "GROUP BY host, gpu").rows
    hosts = sorted({str(h) for h, _, _ in gpus})
    if len(hosts) >= 2**31:
        raise InputError("too many GPU hosts")
    uuids = [(str(u), int(i)) for _, i, u in gpus if u]
    return {"bl": names, "bid": list(range(1, len(names) + 1)), "hosts": hosts,
            "hid": list(range(1, len(hosts) + 1)), "uuids": [u for u, _ in uuids],
            "uuid_idx": [i for _, i in uuids], "host_wide": host_wide}


def _lbin(expr: str, bins: int) -> str:
    """Latency bin of ``expr`` (clamped), in the narrowest unsigned type that holds ``bins``."""
    kind = "UInt8" if bins <= 2**8 else "UInt16" if bins <= 2**16 else "UInt32"
    return f"to{kind}(least(toUInt32(floor(greatest({expr}, 0) / {{lat_bin:Float64}})), {{ln:UInt32}} - 1))"


def _params(spec: HeatmapSpec, start_ns: int, end_ns: int) -> dict[str, Any]:
    max_age_w = int(spec.memory_max_age_s * 1e9) // spec.window_ns
    return {
        "wns": spec.window_ns, "t0": start_ns, "t1": end_ns,
        "m0": start_ns - (max_age_w + 1) * spec.window_ns, "max_age_w": max_age_w,
        "qps_bin": spec.qps_bin, "qn": spec.qps_bins, "mem_bin": spec.memory_bin_bytes, "mn": spec.memory_bins,
        "lat_bin": spec.latency_bin_s, "ln": spec.latency_bins,
    }


def time_range(store: Store, start_ns: int | None, end_ns: int | None) -> tuple[int, int]:
    """Fill a missing bound from the data (first request, last request + 1 ns)."""
    if start_ns is not None and end_ns is not None:
        return start_ns, end_ns
    row = store.query(f"SELECT toUnixTimestamp64Nano(min(ts)), toUnixTimestamp64Nano(max(ts)), count() "
                      f"FROM {qualified(store, REQUESTS)}").rows[0]
    lo, hi = (int(row[0]), int(row[1]) + 1) if int(row[2]) else (0, 0)
    return (lo if start_ns is None else start_ns), (hi if end_ns is None else end_ns)


def tensor_query(store: Store, spec: HeatmapSpec, start_ns: int, end_ns: int,
                 backends: list[str] | None = None, models: list[str] | None = None) -> tuple[np.ndarray, int, int]:
    """The count tensor (ClickHouse GROUP BY of cell index), counted requests, unmatched requests."""
    where, selected, params = _filters(backends, models)
    found = _resolve(store, backends)
    if not found["bl"]:
        return np.zeros(spec.shape, dtype=np.uint64), 0, 0
    payload = (f"groupArrayIf({_lbin('latency_seconds', spec.latency_bins)}, "
               f"isFinite(latency_seconds) AND {selected}) AS lbins")
    host_wide = found.pop("host_wide")
    params.update(found)
    sql = _windows_sql(store, where, payload, "slots.lbins AS lbins", host_wide) + """
SELECT if(matched, (toUInt32(qbin) * {mn:UInt32} + mbin) * {ln:UInt32} + toUInt32(lbin), 4294967295) AS cell,
       count() AS requests
FROM joined ARRAY JOIN lbins AS lbin
GROUP BY cell
"""
    cols = store.query_columns(sql, {**_params(spec, start_ns, end_ns), **params})
    tensor = np.zeros(spec.shape, dtype=np.uint64)
    cells = np.asarray(cols.get("cell", []), dtype=np.int64)
    counts = np.asarray(cols.get("requests", []), dtype=np.uint64)
    unmatched_mask = cells == 4294967295
    unmatched = int(counts[unmatched_mask].sum())
    tensor.reshape(-1)[cells[~unmatched_mask]] = counts[~unmatched_mask]
    return tensor, int(counts[~unmatched_mask].sum()), unmatched


def _codes(store: Store, column: str) -> list[str]:
    """Distinct values of a low-cardinality ``requests`` column (code ``i + 1``; 0 = none of them)."""
    rows = store.query(f"SELECT DISTINCT {column} FROM {qualified(store, REQUESTS)} ORDER BY {column}").rows
    return [str(r[0]) for r in rows][: 2**16 - 1]


def _dominant(keys: list[int], counts: list[int], names: list[str]) -> tuple[str, float]:
    """Most frequent coded value (ties: the first name in sort order) and its share of the cell."""
    if not keys:
        return "", 0.0
    best = max(range(len(keys)), key=lambda i: (counts[i], -keys[i]))
    code = int(keys[best])
    return (names[code - 1] if 0 < code <= len(names) else ""), counts[best] / sum(counts)


_UNMATCHED = 4294967295  # QPS bin of the row that counts requests without a memory sample


def summary_query(store: Store, spec: HeatmapSpec, start_ns: int, end_ns: int,
                  backends: list[str] | None = None, models: list[str] | None = None
                  ) -> tuple[np.ndarray, int, int, list[dict[str, Any]]]:
    """Tensor, counted and unmatched requests, and per (QPS, memory) cell: requests, exact P95
    latency, dominant modality and request class, all in one pass.

    Per cell, ``sumMap`` returns the latency-bin counts (the tensor's third axis) and exact counts of
    the modality and class codes (small integers on the way; the most frequent is named here)."""
    where, selected, params = _filters(backends, models)
    found = _resolve(store, backends)
    if not found["bl"]:
        return np.zeros(spec.shape, dtype=np.uint64), 0, 0, []
    mods, classes = _codes(store, "modality"), _codes(store, "request_class")
    cond = f"isFinite(latency_seconds) AND {selected}"
    code = "transform(toString({col}), {{{name}:Array(String)}}, {{{name}_c:Array(UInt16)}}, toUInt16(0))"
    payload = (f"groupArrayIf(latency_seconds, {cond}) AS lats, "
               f"groupArrayIf({code.format(col='modality', name='ml')}, {cond}) AS mods, "
               f"groupArrayIf({code.format(col='request_class', name='cl')}, {cond}) AS classes")
    host_wide = found.pop("host_wide")
    params.update(found)
    params.update({"ml": mods, "ml_c": list(range(1, len(mods) + 1)),
                   "cl": classes, "cl_c": list(range(1, len(classes) + 1))})
    sql = _windows_sql(store, where, payload, "slots.lats AS lats, slots.mods AS mods, slots.classes AS classes",
                       host_wide) + f"""
SELECT if(matched, qbin, {_UNMATCHED}) AS qbin_, if(matched, mbin, 0) AS mbin_, count() AS requests,
       quantileExactInclusive(0.95)(lat) AS p95_latency_seconds,
       sumMap([{_lbin('lat', spec.latency_bins)}], [toUInt64(1)]) AS lat_counts,
       sumMap([modality], [toUInt64(1)]) AS mod_counts, sumMap([rclass], [toUInt64(1)]) AS class_counts
FROM joined ARRAY JOIN lats AS lat, mods AS modality, classes AS rclass
GROUP BY qbin_, mbin_
ORDER BY requests DESC, qbin_, mbin_
"""
    rows = store.query(sql, {**_params(spec, start_ns, end_ns), **params}).dicts()
    tensor = np.zeros(spec.shape, dtype=np.uint64)
    cells, unmatched = [], 0
    for c in rows:
        if int(c["qbin_"]) == _UNMATCHED:
            unmatched = int(c["requests"])
            continue
        q, m = int(c.pop("qbin_")), int(c.pop("mbin_"))
        lbins, counts = c.pop("lat_counts")
        tensor[q, m, np.asarray(lbins, dtype=np.int64)] = np.asarray(counts, dtype=np.uint64)
        c["qbin"], c["mbin"] = q, m
        mod_keys, mod_counts = c.pop("mod_counts")
        class_keys, class_counts = c.pop("class_counts")
        c["modality"], c["modality_share"] = _dominant(mod_keys, mod_counts, mods)
        c["request_class"], c["request_class_share"] = _dominant(class_keys, class_counts, classes)
        cells.append(c)
    return tensor, int(tensor.sum()), unmatched, cells


def cell_summary_query(store: Store, spec: HeatmapSpec, start_ns: int, end_ns: int,
                       backends: list[str] | None = None, models: list[str] | None = None
                       ) -> list[dict[str, Any]]:
    """Per (QPS, memory) cell: requests, exact P95 latency, dominant modality and request class."""
    return summary_query(store, spec, start_ns, end_ns, backends, models)[3]


def compute_heatmap(store: Store, spec: HeatmapSpec | None = None, start_ns: int | None = None,
                    end_ns: int | None = None, backends: list[str] | None = None,
                    models: list[str] | None = None, summaries: bool = True, top: int = 10) -> HeatmapResult:
    """Tensor, P95 grid and typical load patterns for ``[start_ns, end_ns)``.

    With ``summaries`` one query yields all of them; without, the leaner :func:`tensor_query` runs."""
    spec = spec or HeatmapSpec()
    spec.validate()
    t0 = time.perf_counter()
    bounded = start_ns is not None and end_ns is not None
    start_ns, end_ns = time_range(store, start_ns, end_ns)
    if not bounded and start_ns == end_ns == 0:
        raise InputError("empty time range: the store has no requests")
    if end_ns <= start_ns:
        raise InputError(f"empty time range: from {start_ns} to {end_ns} (ns)")
    if not summaries:
        tensor, counted, unmatched = tensor_query(store, spec, start_ns, end_ns, backends, models)
        result = HeatmapResult(spec, tensor, start_ns, end_ns, counted, unmatched)
    else:
        tensor, counted, unmatched, cells = summary_query(store, spec, start_ns, end_ns, backends, models)
        result = HeatmapResult(spec, tensor, start_ns, end_ns, counted, unmatched)
        grid = np.full(spec.shape[:2], np.nan)
        for c in cells:
            grid[c["qbin"], c["mbin"]] = float(c["p95_latency_seconds"])
        result.p95_grid = grid
        result.patterns = [pattern(spec, c, counted) for c in cells[:top]]
    result.seconds = time.perf_counter() - t0
    return result
