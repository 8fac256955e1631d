"""Pure parsers for block-IO latency outputs, and percentiles from log2 histograms.

A histogram is a list of :class:`Bucket` in microseconds (the unit every tool here prints).
Percentiles interpolate linearly inside the bucket that holds the requested rank: with ``c``
requests below bucket ``[lo, hi)`` of count ``n``, rank ``r = q * total`` maps to
``lo + (hi - lo) * (r - c) / n``. Exact buckets (bpftrace ``[0]``, ``[1]``) return their value;
the open top bucket (``[4M, ...)``) returns its lower bound, and negatives ``(..., 0)`` count as 0.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from triscope.errors import InputError
from triscope.prom_text import parse_exposition

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


@dataclass(frozen=True)
class Bucket:
    """Values in ``[lo, hi)`` microseconds; ``lo == hi`` means exactly ``lo``; ``hi`` may be inf."""

    lo: float
    hi: float
    count: float


@dataclass
class Hist:
    """One latency histogram with its labels (device as printed by the tool, op, optional flags)."""

    device: str
    op: str
    buckets: list[Bucket]
    ts: str = ""

    @property
    def count(self) -> float:
        return sum(b.count for b in self.buckets)


def percentile(buckets: Iterable[Bucket], q: float) -> float:
    """q-quantile (0..1) in the buckets' unit, interpolated within the bucket; NaN when empty."""
    bs = sorted((b for b in buckets if b.count > 0), key=lambda b: b.lo)
    total = sum(b.count for b in bs)
    if total <= 0:
        return math.nan
    rank = q * total
    below = 0.0
    for b in bs:
        if below + b.count >= rank:
            lo = max(b.lo, 0.0)
            if b.hi == b.lo or math.isinf(b.hi):
                return lo
            return lo + (max(b.hi, lo) - lo) * (rank - below) / b.count
        below += b.count
    return max(bs[-1].lo, 0.0)


def mean_estimate(buckets: Iterable[Bucket]) -> float:
    """Mean using bucket midpoints (the lower bound for exact and open buckets); NaN when empty."""
    num = den = 0.0
    for b in buckets:
        lo = max(b.lo, 0.0)
        mid = lo if (b.hi == b.lo or math.isinf(b.hi)) else (lo + b.hi) / 2
        num += mid * b.count
        den += b.count
    return num / den if den else math.nan


def op_from_rwbs(rwbs: str) -> str:
    """read / write / discard / other from a kernel rwbs string (e.g. ``WS``, ``RA``, ``FWFS``)."""
    if "D" in rwbs:
        return "discard"
    if "W" in rwbs:
        return "write"
    if "R" in rwbs:
        return "read"
    return "other"


def op_from_flags(flags: str) -> str:
    """read / write / discard / other from bcc/libbpf ``-F`` flag names (``NoMerge-Sync-Write``)."""
    parts = set(flags.split("-"))
    for name, op in (("Discard", "discard"), ("Write", "write"), ("Read", "read")):
        if name in parts:
            return op
    return "other"


# --- bpftrace text ---------------------------------------------------------------------------

_BT_HEAD = re.compile(r"^@(?P<name>\w*)(?:\[(?P<key>[^\]]*)\])?:\s*$")
_BT_RANGE = re.compile(r"^\[(?P<lo>-?\d+)(?P<ls>[KMGTP]?),\s*(?P<hi>\.\.\.|-?\d+)(?P<hs>[KMGTP]?)\)\s+(?P<n>\d+)\s*\|")
_BT_EXACT = re.compile(r"^\[(?P<v>-?\d+)(?P<s>[KMGTP]?)\]\s+(?P<n>\d+)\s*\|")
_BT_NEG = re.compile(r"^\(\.\.\.,\s*(?P<hi>-?\d+)\)\s+(?P<n>\d+)\s*\|")
_BT_SCALAR = re.compile(r"^@(?P<name>\w*)(?:\[(?P<key>[^\]]*)\])?:\s+(?P<v>-?\d+)\s*$")


def bpftrace_text_bucket(line: str) -> Bucket | None:
    """One ``[lo, hi) count |@@|`` line (also ``[0]``, ``(..., 0)``, ``[4M, ...)``), else None."""
    s = line.strip()
    if m := _BT_RANGE.match(s):
        lo = int(m["lo"]) * _SUFFIX[m["ls"]]
        hi = math.inf if m["hi"] == "..." else int(m["hi"]) * _SUFFIX[m["hs"]]
        return Bucket(lo, hi, int(m["n"]))
    if m := _BT_EXACT.match(s):
        v = int(m["v"]) * _SUFFIX[m["s"]]
        return Bucket(v, v, int(m["n"]))
    if m := _BT_NEG.match(s):
        return Bucket(-math.inf, int(m["hi"]), int(m["n"]))
    return None


@dataclass
class BpftraceText:
    """Result of parsing bpftrace text output: histograms and integer maps, keyed by map name."""

    hists: dict[str, dict[str, list[Bucket]]]
    scalars: dict[str, dict[str, int]]
    errors: list[str]


def parse_bpftrace_text(lines: Iterable[str]) -> BpftraceText:
    """Histograms (``@name[key]:`` then bucket lines) and ``@name[key]: N`` values; bad lines are
    recorded in ``errors`` (one line each) and skipped."""
    out = BpftraceText({}, {}, [])
    current: list[Bucket] | None = None
    for raw in lines:
        line = raw.rstrip("\n")
        if not line.strip():
            current = None
            continue
        if current is not None and (b := bpftrace_text_bucket(line)) is not None:
            current.append(b)
            continue
        if m := _BT_HEAD.match(line.strip()):
            current = out.hists.setdefault("@" + m["name"], {}).setdefault(_norm_key(m["key"]), [])
            continue
        current = None
        if m := _BT_SCALAR.match(line.strip()):
            out.scalars.setdefault("@" + m["name"], {})[_norm_key(m["key"])] = int(m["v"])
            continue
        if line.startswith("@") or line.lstrip().startswith("["):
            out.errors.append(f"bpftrace text: unparsable line: {line[:120]!r}")
    return out


def _norm_key(key: str | None) -> str:
    return ",".join(p.strip() for p in key.split(",")) if key else ""


# --- bpftrace -f json -------------------------------------------------------------------------


def _json_buckets(items: list[dict]) -> list[Bucket]:
    out = []
    for it in items:
        n = it["count"]
        if "min" not in it:
            out.append(Bucket(-math.inf, it["max"] + 1, n))
        elif "max" not in it:
            out.append(Bucket(it["min"], math.inf, n))
        elif it["min"] == it["max"]:
            out.append(Bucket(it["min"], it["min"], n))
        else:
            out.append(Bucket(it["min"], it["max"] + 1, n))
    return out


def parse_bpftrace_json_record(record: dict) -> tuple[str, dict[str, dict[str, object]]]:
    """One ``-f json`` record -> (type, {map: {key: buckets or value}}); key "" for unkeyed maps."""
    kind = record.get("type", "")
    data = record.get("data")
    out: dict[str, dict[str, object]] = {}
    if kind in ("hist", "map", "stats") and isinstance(data, dict):
        for name, value in data.items():
            keyed = value if isinstance(value, dict) and kind != "stats" or (
                kind == "stats" and isinstance(value, dict) and "count" not in value) else {"": value}
            out[name] = {
                _norm_key(k): (_json_buckets(v) if kind == "hist" else v) for k, v in keyed.items()
            }
    return kind, out


def iter_json_documents(text: str) -> Iterator[dict]:
    """Successive JSON objects in ``text`` (one per line, or pretty-printed over many lines)."""
    dec = json.JSONDecoder()
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            raise InputError(f"bpftrace json: invalid JSON at offset {i}: {exc.msg}") from None
        if isinstance(obj, dict):
            yield obj


def parse_bpftrace_json(text: str) -> dict[str, dict[str, list[Bucket]]]:
    """All ``hist`` records of a bpftrace ``-f json`` stream: {map: {key: buckets}} (last wins)."""
    out: dict[str, dict[str, list[Bucket]]] = {}
    for rec in iter_json_documents(text):
        kind, maps = parse_bpftrace_json_record(rec)
        if kind == "hist":
            for name, keyed in maps.items():
                out.setdefault(name, {}).update(keyed)  # type: ignore[arg-type]
    return out


# --- bcc / libbpf-tools biolatency ------------------------------------------------------------

_BCC_UNIT = re.compile(r"^\s*(?P<unit>usecs|msecs|nsecs)\s*:\s*count\s+distribution")
_BCC_ROW = re.compile(r"^\s*(?P<lo>\d+)\s*->\s*(?P<hi>\d+)\s*:\s*(?P<n>\d+)\s*\|")
_BCC_DISK = re.compile(r"^\s*(?:Bucket\s+)?disk\s*=\s*'?(?P<d>[^'\s]+)'?\s*$")
_BCC_FLAGS = re.compile(r"^\s*flags\s*=\s*(?P<f>\S+)\s*$")
_BCC_TS = re.compile(r"^\s*(?P<t>\d\d:\d\d:\d\d)\s*$")
_UNIT_US = {"usecs": 1.0, "msecs": 1000.0, "nsecs": 0.001}


def parse_biolatency_text(lines: Iterable[str]) -> list[Hist]:
    """bcc / libbpf-tools biolatency text histograms (plain, ``-D``, ``-F``, ``-T``, ``-m``).

    Rows ``a -> b`` are inclusive integer ranges, i.e. ``[a, b + 1)``; buckets are converted to
    microseconds. ``device`` is ``""`` unless ``-D``; ``op`` comes from ``-F`` flags, else ``all``."""
    out: list[Hist] = []
    disk, flags, ts = "", "", ""
    current: Hist | None = None
    scale = 1.0
    for line in lines:
        if line.startswith(("Tracing block device", "# ")):  # a new run: labels start afresh
            disk, flags, ts, current = "", "", "", None
        elif m := _BCC_TS.match(line):
            ts = m["t"]
        elif m := _BCC_DISK.match(line):
            disk = m["d"]
        elif m := _BCC_FLAGS.match(line):
            flags = m["f"]
        elif m := _BCC_UNIT.match(line):
            scale = _UNIT_US[m["unit"]]
            current = Hist(disk, op_from_flags(flags) if flags else "all", [], ts)
            out.append(current)
        elif current is not None and (m := _BCC_ROW.match(line)):
            lo, hi = int(m["lo"]), int(m["hi"]) + 1
            current.buckets.append(Bucket(lo * scale, hi * scale, int(m["n"])))
        else:
            current = None
    return out


def parse_bcc_json(lines: Iterable[str]) -> list[Hist]:
    """bcc ``biolatency -j`` output: one Python dict literal per line (not JSON; may hold
    ``b'sda'``). Parsed with :func:`ast.literal_eval`; a bad line raises InputError."""
    out = []
    for line in lines:
        s = line.strip()
        if not s.startswith("{"):
            continue
        try:
            d = ast.literal_eval(s)
            scale = _UNIT_US[d.get("val_type", "usecs")]
            buckets = [Bucket(b["interval-start"] * scale, (b["interval-end"] + 1) * scale, b["count"])
                       for b in d["data"]]
        except (ValueError, SyntaxError, KeyError, TypeError, AttributeError, MemoryError,
                RecursionError) as exc:
            raise InputError(f"bcc -j: not a histogram dict: {type(exc).__name__}: {s[:80]!r}") from None
        dev = d.get("Bucket ptr", "")
        dev = dev.decode(errors="replace") if isinstance(dev, bytes) else str(dev)
        op = op_from_flags(d["flags"]) if "flags" in d else "all"
        out.append(Hist(dev, op, buckets, str(d.get("ts", ""))))
    return out


# --- ebpf_exporter Prometheus text ------------------------------------------------------------


def parse_ebpf_exporter(text: str, metric: str = "ebpf_exporter_bio_latency_seconds") -> list[Hist]:
    """Cumulative ``<metric>_bucket{device,operation,le}`` series -> per-bucket Hists (microseconds).

    Bucket ``i`` spans ``(le[i-1], le[i]]``; the ``+Inf`` bucket is open-ended."""
    cum: dict[tuple[str, str], dict[float, float]] = {}
    for labels, value in parse_exposition(text, "ebpf_exporter").get(metric + "_bucket", []):
        key = (labels.get("device", ""), labels.get("operation", "all"))
        try:
            cum.setdefault(key, {})[float(labels["le"])] = value
        except (KeyError, ValueError):
            raise InputError(f"ebpf_exporter: not a histogram bucket: {metric}_bucket{labels}") from None
    return [Hist(dev, op, cumulative_to_buckets(c)) for (dev, op), c in sorted(cum.items())]


def cumulative_to_buckets(cum: dict[float, float]) -> list[Bucket]:
    """Prometheus cumulative ``le`` (seconds) counts -> per-bucket microsecond Buckets."""
    out, prev_le, prev_n = [], 0.0, 0.0
    for le in sorted(cum):
        n = cum[le]
        out.append(Bucket(prev_le * 1e6, math.inf if math.isinf(le) else le * 1e6, max(n - prev_n, 0.0)))
        prev_le, prev_n = le, n
    return out
