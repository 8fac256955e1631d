"""dcgm-exporter scraper for ``gpu_samples``: one row per GPU and scrape, from every ``[dcgm] urls`` target.

Each target is fetched with a timeout and a bounded body and parsed line by line (a malformed
line is skipped, not the scrape); its ``DCGM_FI_*`` series fold into one row per (host, GPU) in
triscope units; DCGM blank values become NaN. A failing target never raises: it yields state rows
(``unreachable`` / ``error`` + a one-line ``error``). Labels, units, blanks and states:
docs/gpu-collectors.md. Registry name ``dcgm`` -> :func:`create`; config :class:`DcgmConfig`.
"""

from __future__ import annotations

import logging
import math
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from triscope.component import ComponentConfig, Context, interval
from triscope.errors import ConfigError, InputError
from triscope.schema import GPU_SAMPLES, encode_ts

log = logging.getLogger(__name__)

NAN = math.nan
MiB = float(1 << 20)
NO_GPU = 65535
"""``gpu`` of a target-level state row (a target that failed before any GPU was seen there)."""

_EMPTY_ROW: dict[str, Any] = {**GPU_SAMPLES.defaults(),
                               **{c.name: NAN for c in GPU_SAMPLES.columns if c.type.startswith("Float")}}
"""A row before a scrape fills it: a metric not seen is NaN, not 0."""


@dataclass(frozen=True)
class DcgmConfig(ComponentConfig):
    """``[dcgm]`` (docs/gpu-collectors.md)."""

    section = "dcgm"
    urls: list[str] = field(default_factory=list)
    """dcgm-exporter endpoints, e.g. ``["http://gpu-node-17:9400/metrics"]``."""
    interval_s: float = 5.0
    """No faster than dcgm-exporter refreshes (its -c, 30 s by default)."""
    timeout_s: float = 2.0
    max_body_bytes: int = 8 << 20
    """~30 series x 8 GPUs is ~100 KiB; anything far larger is not an exporter."""

    def validate(self, where: str) -> None:
        if not self.urls:
            raise ConfigError(f"{where} urls is empty; name the dcgm-exporter endpoints, e.g. "
                              '["http://gpu-node-17:9400/metrics"]')
        for url in self.urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"{where} url {url!r} is not an http(s) URL")
        if not (self.interval_s > 0 and self.timeout_s > 0 and self.max_body_bytes > 0):
            raise ConfigError(f"{where} interval_s, timeout_s and max_body_bytes must be positive")
        interval(where, interval_s=self.interval_s)

# DCGM blank values (dcgm_structs.h, DCGM_BLANK_VALUES): base + 0..15 (NOT_FOUND +1, NOT_SUPPORTED +2, ...).
DCGM_INT32_BLANK = 0x7FFFFFF0
DCGM_INT64_BLANK = 0x7FFFFFFFFFFFFFF0
DCGM_FP64_BLANK = 140737488355328.0  # 2**47


def is_blank(value: float, small: bool) -> bool:
    """True for a DCGM blank/sentinel value; ``small``: the field cannot legitimately reach 2**31."""
    if not math.isfinite(value):
        return True
    if value >= float(DCGM_INT64_BLANK):  # as parsed to float every int64 blank rounds to 2**63
        return True
    if DCGM_FP64_BLANK <= value < DCGM_FP64_BLANK + 16:
        return True
    return small and DCGM_INT32_BLANK <= value <= 0x7FFFFFFF


@dataclass(frozen=True)
class Field:
    """How one DCGM series lands in a column: ``column = value * scale / div``; lower ``rank`` wins."""

    column: str
    scale: float = 1.0
    div: float = 1.0
    rank: int = 0
    small: bool = True  # int32 blanks apply (gauges far below 2**31)


FIELDS: dict[str, Field] = {
    "DCGM_FI_DEV_FB_USED": Field("memory_used_bytes", MiB),
    "DCGM_FI_DEV_FB_TOTAL": Field("memory_total_bytes", MiB),
    "DCGM_FI_DEV_FB_RESERVED": Field("memory_reserved_bytes", MiB),
    "DCGM_FI_DEV_FB_FREE": Field("_fb_free_bytes", MiB),  # total = used + free + reserved without FB_TOTAL
    "DCGM_FI_DEV_GPU_UTIL": Field("gpu_util_ratio", div=100.0),  # percent
    "DCGM_FI_DEV_MEM_COPY_UTIL": Field("memory_util_ratio", div=100.0),
    "DCGM_FI_PROF_SM_ACTIVE": Field("sm_active_ratio"),
    "DCGM_FI_PROF_SM_OCCUPANCY": Field("sm_occupancy_ratio"),
    "DCGM_FI_PROF_DRAM_ACTIVE": Field("dram_active_ratio"),
    "DCGM_FI_DEV_SM_CLOCK": Field("sm_clock_hz", 1e6),
    "DCGM_FI_DEV_POWER_USAGE": Field("power_watts"),
    "DCGM_FI_DEV_POWER_USAGE_INSTANT": Field("power_watts", rank=1),
    "DCGM_FI_DEV_GPU_TEMP": Field("temperature_celsius"),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": Field("clock_event_reasons"),
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": Field("clock_event_reasons", rank=1),  # pre-3.3 name
    "DCGM_FI_PROF_PCIE_TX_BYTES": Field("pcie_tx_bytes_per_second", small=False),  # bytes/s (DCP)
    "DCGM_FI_PROF_PCIE_RX_BYTES": Field("pcie_rx_bytes_per_second", small=False),
    "DCGM_FI_DEV_PCIE_TX_THROUGHPUT": Field("pcie_tx_bytes_per_second", 1024.0, rank=1, small=False),  # KB/s
    "DCGM_FI_DEV_PCIE_RX_THROUGHPUT": Field("pcie_rx_bytes_per_second", 1024.0, rank=1, small=False),
    "DCGM_FI_PROF_NVLINK_TX_BYTES": Field("nvlink_tx_bytes_per_second", small=False),  # bytes/s, all links
    "DCGM_FI_PROF_NVLINK_RX_BYTES": Field("nvlink_rx_bytes_per_second", small=False),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": Field("ecc_corrected_total", small=False),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": Field("ecc_uncorrected_total", small=False),
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": Field("ecc_corrected_total", rank=1, small=False),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": Field("ecc_uncorrected_total", rank=1, small=False),
}
"""DCGM series -> gpu_samples column. Not mapped on purpose: NVLINK_BANDWIDTH_TOTAL (tx+rx in one
counter), energy, XID, remapped rows, tensor/fp pipes, GR_ENGINE_ACTIVE (not SM activity)."""

# ------------------------------------------------------------------------------- text parsing

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+-?\d+)?[ \t]*\r?")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(,|$)')
_UNESCAPE = re.compile(r"\\(.)")


def _labels(body: str) -> dict[str, str] | None:
    out: dict[str, str] = {}
    pos, n = 0, len(body.rstrip())
    while pos < n:
        m = _LABEL.match(body, pos)
        if m is None:
            return None
        value = m.group(2)
        if "\\" in value:
            value = _UNESCAPE.sub(lambda e: "\n" if e.group(1) == "n" else e.group(1), value)
        out[m.group(1)] = value
        pos = m.end()
        if not m.group(3):
            break
    return out if pos >= n else None


@dataclass
class Parsed:
    """DCGM samples of one exposition and the lines that were not Prometheus text."""

    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)
    bad_lines: int = 0
    first_bad: str = ""


def parse_exposition(text: str, names: Iterable[str] | None = None) -> Parsed:
    """Samples of the series in ``names`` (default: :data:`FIELDS`); malformed lines are counted, not fatal."""
    wanted = set(FIELDS if names is None else names)
    out = Parsed()
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line or line[0] == "#" or line.isspace():
            continue
        m = _SAMPLE.fullmatch(line)
        value: float | None = None
        labels: dict[str, str] | None = {}
        if m is not None:
            if m.group(1) not in wanted:
                continue  # another family (or a DCGM one we do not map): not even parsed further
            if m.group(2):
                labels = _labels(m.group(2))
            try:
                value = float(m.group(3))
            except ValueError:
                value = None
        if m is None or labels is None or value is None:
            out.bad_lines += 1
            if not out.first_bad:
                out.first_bad = f"line {lineno}: {line.strip()[:80]!r}"
            continue
        out.samples.append((m.group(1), labels, value))
    return out


# ------------------------------------------------------------------------------- rows

@dataclass
class _Gpu:
    host: str
    index: int
    uuid: str = ""
    model: str = ""
    pods: dict[tuple[str, str, str], None] = field(default_factory=dict)  # ordered set
    values: dict[str, tuple[int, float]] = field(default_factory=dict)     # column -> (rank, value)


def fold(parsed: Parsed, default_host: str) -> list[_Gpu]:
    """One entry per (host, GPU index) with the best-ranked value of each column."""
    gpus: dict[tuple[str, int], _Gpu] = {}
    for name, labels, raw in parsed.samples:
        if labels.get("GPU_I_ID"):
            continue  # MIG instance series: no per-instance column in gpu_samples
        try:
            index = int(labels.get("gpu", ""))
        except ValueError:
            continue  # not a GPU entity (NVSwitch, CPU, ...)
        if not 0 <= index < NO_GPU:
            continue
        host = labels.get("Hostname") or labels.get("hostname") or default_host
        g = gpus.get((host, index))
        if g is None:
            g = gpus[(host, index)] = _Gpu(host, index)
        g.uuid = g.uuid or labels.get("UUID", "")
        g.model = g.model or labels.get("modelName", "")
        pod = (labels.get("pod", ""), labels.get("namespace", ""), labels.get("container", ""))
        if pod[0]:
            g.pods[pod] = None
        spec = FIELDS[name]
        value = NAN if is_blank(raw, spec.small) else raw * spec.scale / spec.div
        have = g.values.get(spec.column)  # keep the finite value of the lowest rank (first one on a tie)
        if have is None or (math.isfinite(value) and (not math.isfinite(have[1]) or spec.rank < have[0])):
            g.values[spec.column] = (spec.rank, value)
    return [gpus[k] for k in sorted(gpus)]


def _row(ts: str, g: _Gpu, state: str, error: str) -> dict[str, Any]:
    v = {c: val for c, (_, val) in g.values.items()}
    used, free, reserved = (v.get(k, NAN) for k in ("memory_used_bytes", "_fb_free_bytes", "memory_reserved_bytes"))
    total = v.get("memory_total_bytes", NAN)
    if not math.isfinite(total) and math.isfinite(used) and math.isfinite(free):
        total = used + free + (reserved if math.isfinite(reserved) else 0.0)
    reasons = v.get("clock_event_reasons", NAN)
    pods = list(g.pods)
    row = dict(_EMPTY_ROW)
    row.update(v)
    row.pop("_fb_free_bytes", None)
    row.update({
        "ts": ts, "host": g.host, "gpu": g.index, "gpu_uuid": g.uuid, "gpu_model": g.model, "source": "dcgm",
        "memory_total_bytes": total,
        "clock_event_reasons": int(reasons) & 0x7FFF_FFFF_FFFF_FFFF if math.isfinite(reasons) else 0,
        "state": state, "error": error,
        "pod": ",".join(dict.fromkeys(p for p, _, _ in pods)),
        "namespace": ",".join(dict.fromkeys(n for _, n, _ in pods if n)),
        "container": ",".join(dict.fromkeys(c for _, _, c in pods if c)),
    })
    return row


def rows_from_text(text: str, default_host: str, ts_ns: int, source: str = "metrics") -> tuple[list[dict[str, Any]],
                                                                                            str]:
    """(rows, warning) of one exposition; InputError (one line) when it holds no DCGM GPU series."""
    parsed = parse_exposition(text)
    gpus = fold(parsed, default_host)
    if not gpus:
        if parsed.bad_lines:
            raise InputError(f"{source}: not Prometheus text ({parsed.bad_lines} bad lines; first {parsed.first_bad})")
        raise InputError(f"{source}: no DCGM_FI_* GPU series in the response")
    warning = ""
    if parsed.bad_lines:
        warning = f"{source}: skipped {parsed.bad_lines} malformed lines (first {parsed.first_bad})"
    ts = encode_ts(ts_ns)
    return [_row(ts, g, "ok", warning) for g in gpus], warning


# ------------------------------------------------------------------------------- collector

@dataclass
class Target:
    """One dcgm-exporter endpoint and what was last seen there."""

    url: str
    host: str = ""
    seen: dict[tuple[str, int], _Gpu] = field(default_factory=dict)
    last_error: str = ""

    def __post_init__(self) -> None:
        self.host = self.host or urlsplit(self.url).hostname or ""


class UnreachableError(InputError):
    """The target did not answer with a body (connection, timeout, HTTP status)."""


def fetch(url: str, timeout_s: float, max_body_bytes: int) -> str:
    """GET ``url``; at most ``max_body_bytes``; UnreachableError / InputError (one line) on failure."""
    req = urllib.request.Request(url, headers={"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "identity"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read(max_body_bytes + 1)
    except urllib.error.HTTPError as exc:
        raise UnreachableError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise UnreachableError(f"{url}: scrape failed: {str(reason).splitlines()[0] if str(reason) else reason!r}") \
            from None
    if len(body) > max_body_bytes:
        raise InputError(f"{url}: response exceeds max_body_bytes = {max_body_bytes}")
    return body.decode("utf-8", errors="replace")


class DcgmScraper:
    """Collector scraping dcgm-exporter targets; ``config`` is a :class:`DcgmConfig` or the whole configuration."""

    name = "dcgm"

    def __init__(self, config: Mapping[str, Any] | DcgmConfig | None = None,
                 fetcher: Callable[[str, float, int], str] | None = None) -> None:
        cfg = config if isinstance(config, DcgmConfig) else DcgmConfig.from_config(config)
        self.targets = [Target(u) for u in cfg.urls]
        self.interval_s = cfg.interval_s
        self.timeout_s = cfg.timeout_s
        self.max_body_bytes = cfg.max_body_bytes
        self.fetcher = fetcher or fetch
        self._pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        """A small thread pool so one slow target does not delay the others."""
        if self._pool is None and len(self.targets) > 1:
            self._pool = ThreadPoolExecutor(max_workers=min(8, len(self.targets)), thread_name_prefix="dcgm")

    def _scrape(self, target: Target, ts_ns: int) -> list[dict[str, Any]]:
        try:
            rows, warning = rows_from_text(self.fetcher(target.url, self.timeout_s, self.max_body_bytes),
                                           target.host, ts_ns, target.url)
        except InputError as exc:
            state = "unreachable" if isinstance(exc, UnreachableError) else "error"
            message = str(exc).splitlines()[0]
            if message != target.last_error:
                log.warning("dcgm: %s", message)
            target.last_error = message
            ts = encode_ts(ts_ns)
            known = list(target.seen.values()) or [_Gpu(target.host, NO_GPU)]
            return [_row(ts, _Gpu(g.host, g.index, g.uuid, g.model), state, message) for g in known]
        if target.last_error and not warning:
            log.warning("dcgm: %s answers again", target.url)
        elif warning and warning != target.last_error:
            log.warning("dcgm: %s", warning)
        target.last_error = warning
        target.seen = {(r["host"], r["gpu"]): _Gpu(r["host"], r["gpu"], r["gpu_uuid"], r["gpu_model"]) for r in rows}
        return rows

    def _each(self, ts_ns: int) -> Iterator[list[dict[str, Any]]]:
        if self._pool is None:
            for t in self.targets:
                yield self._scrape(t, ts_ns)
        else:
            yield from self._pool.map(lambda t: self._scrape(t, ts_ns), self.targets)

    def collect(self) -> dict[str, dict[str, list[Any]]]:
        """Scrape every target once; failed targets become state rows (never raises for a target)."""
        rows = [row for batch in self._each(time.time_ns()) for row in batch]
        return {GPU_SAMPLES.name: GPU_SAMPLES.columns_of(rows)} if rows else {}

    def close(self) -> None:
        """Stop the thread pool; safe to call twice."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def create(config: dict[str, Any], context: Context) -> DcgmScraper:
    """The dcgm-exporter scraper (``[dcgm]``)."""
    return DcgmScraper(DcgmConfig.from_config(config))
