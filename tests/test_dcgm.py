"""dcgm-exporter scraper tests on the reference files in ../shared/data/dcgm.

No test doubles: the files are parsed as they are, served by a real HTTP server on 127.0.0.1,
and the rows go through the embedded store. The counter CSVs (dcgm-exporter's field lists) are
rendered into an exposition the way dcgm-exporter formats one, to check every listed field.
"""

from __future__ import annotations

import contextlib
import http.server
import math
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, shared_data
from prometheus_client.parser import text_string_to_metric_families

from triscope.collectors.dcgm import (
    FIELDS,
    NO_GPU,
    DcgmScraper,
    create,
    is_blank,
    parse_exposition,
    rows_from_text,
)
from triscope.component import Context
from triscope.errors import ConfigError, InputError
from triscope.schema import add_columns, migrate, qualified, schema_versions
from triscope.schema import gpu as gpu_schema
from triscope.schema.gpu import GPU_SAMPLES
from triscope.schema.model import create_table_sql

MiB = 1 << 20
SYNTHETIC = "synthetic_h100_k8s_full_labels.prom"
README = "dcgm-exporter_README_metrics_example.txt"
CSVS = ("default-counters.csv", "dcp-metrics-included.csv")
T0 = 1_750_000_000_000_000_000


def text_of(name: str) -> str:
    return shared_data("dcgm", name).read_text()


def by_gpu(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["gpu"]: r for r in rows}


def test_synthetic_h100_exposition_maps_every_column() -> None:
    rows, warning = rows_from_text(text_of(SYNTHETIC), "fallback-host", T0)
    assert warning == "" and len(rows) == 2
    g0, g1 = by_gpu(rows)[0], by_gpu(rows)[1]
    assert set(g0) == set(GPU_SAMPLES.column_names())
    assert (g0["ts"], g0["host"], g0["gpu_uuid"], g0["gpu_model"], g0["source"], g0["state"], g0["error"]) == (
        "2025-06-15 15:06:40.000000000", "gpu-node-17", "GPU-52e6b438-f2a7-269e-6513-0c5ca6a3a450",
        "NVIDIA H100 80GB HBM3", "dcgm", "ok", "")
    assert g0["memory_used_bytes"] == 77615 * MiB and g0["memory_reserved_bytes"] == 553 * MiB
    assert g0["memory_total_bytes"] == (77615 + 3012 + 553) * MiB  # no FB_TOTAL: used + free + reserved
    assert g0["gpu_util_ratio"] == 0.97 and g0["memory_util_ratio"] == 0.41
    assert g0["sm_clock_hz"] == 1980e6 and g0["power_watts"] == 512.331 and g0["temperature_celsius"] == 58
    assert g0["dram_active_ratio"] == 0.583301
    assert g0["pcie_tx_bytes_per_second"] == 18804211 and g0["pcie_rx_bytes_per_second"] == 402211877
    for absent in ("sm_active_ratio", "sm_occupancy_ratio", "nvlink_tx_bytes_per_second", "ecc_corrected_total",
                   "l2_bandwidth_ratio"):
        assert math.isnan(g0[absent]), absent  # not exported by this configuration
    assert (g0["pod"], g0["namespace"], g0["container"]) == ("vllm-llama3-70b-0", "inference", "vllm")
    assert (g1["pod"], g1["namespace"], g1["container"]) == ("", "", "")  # not allocated to a pod
    assert g1["memory_used_bytes"] == 0 and g1["sm_clock_hz"] == 345e6 and g1["power_watts"] == 71.204


def test_own_parser_agrees_with_prometheus_client() -> None:
    """Every DCGM_FI_* sample of the synthetic file, as prometheus_client's reference parser reads it."""
    text = text_of(SYNTHETIC)
    ref = sorted((s.name if s.name in text else fam.name, tuple(sorted(s.labels.items())), s.value)
                 for fam in text_string_to_metric_families(text) for s in fam.samples if s.name.startswith("DCGM_FI_"))
    names = {n for n, _, _ in ref}
    mine = parse_exposition(text, names)
    assert mine.bad_lines == 0
    assert sorted((n, tuple(sorted(lab.items())), v) for n, lab, v in mine.samples) == ref
    assert len(ref) == 50
    # escapes, a trailing comma, spaces around '=' and a millisecond timestamp
    p = parse_exposition('DCGM_FI_DEV_GPU_TEMP{gpu = "3",modelName="A \\"x\\" \\\\ y\\nz",} 41 1750000000000\n')
    assert p.samples == [("DCGM_FI_DEV_GPU_TEMP", {"gpu": "3", "modelName": 'A "x" \\ y\nz'}, 41.0)]


def test_hostname_label_old_and_new_and_fallback() -> None:
    text = text_of(SYNTHETIC)
    new = text.replace("Hostname=", "hostname=")
    assert new != text
    assert {r["host"] for r in rows_from_text(new, "fallback", T0)[0]} == {"gpu-node-17"}
    bare = re.sub(r',Hostname="[^"]*"', "", text)
    assert {r["host"] for r in rows_from_text(bare, "10.0.0.5", T0)[0]} == {"10.0.0.5"}


def test_dcgm_blank_values_become_nan() -> None:
    """Sentinels from dcgm_structs.h: INT64 NOT_SUPPORTED, INT32 BLANK, FP64 NOT_SUPPORTED."""
    text = text_of(SYNTHETIC)

    def put(t: str, field: str, gpu: str, value: str) -> str:
        pat = re.compile(rf'^({field}\{{gpu="{gpu}"[^\n]*\}}) \S+$', re.M)
        out, n = pat.subn(rf"\g<1> {value}", t)
        assert n == 1, field
        return out

    text = put(text, "DCGM_FI_DEV_GPU_TEMP", "0", "9223372036854775794")  # DCGM_INT64_NOT_SUPPORTED
    text = put(text, "DCGM_FI_DEV_SM_CLOCK", "1", "2147483632")           # DCGM_INT32_BLANK
    text = put(text, "DCGM_FI_DEV_POWER_USAGE", "0", "140737488355330")   # DCGM_FP64_NOT_SUPPORTED
    text = put(text, "DCGM_FI_DEV_FB_USED", "1", "2147483635")            # int32 blank on a MiB gauge
    text = put(text, "DCGM_FI_PROF_PCIE_TX_BYTES", "0", "2147483640")     # a real 2.1 GB/s rate: kept
    g = by_gpu(rows_from_text(text, "h", T0)[0])
    assert math.isnan(g[0]["temperature_celsius"]) and math.isnan(g[1]["sm_clock_hz"])
    assert math.isnan(g[0]["power_watts"]) and math.isnan(g[1]["memory_used_bytes"])
    assert math.isnan(g[1]["memory_total_bytes"])  # used unknown: no total from used + free
    assert g[0]["pcie_tx_bytes_per_second"] == 2147483640
    assert g[0]["sm_clock_hz"] == 1980e6 and g[1]["temperature_celsius"] == 29  # neighbours untouched
    assert is_blank(float("nan"), False) and not is_blank(2147483632.0, small=False)
    assert is_blank(float(0x7FFFFFFFFFFFFFF0), small=False) and not is_blank(9.2e18, small=False)


def test_readme_example_verbatim() -> None:
    """The README quote mixes shell lines and '...' with samples: the samples still count."""
    text = text_of(README)
    rows, warning = rows_from_text(text, "localhost", T0, "readme")
    assert [(r["gpu"], r["gpu_uuid"], r["host"], r["state"]) for r in rows] == [
        (0, "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52", "localhost", "ok")]
    assert rows[0]["sm_clock_hz"] == 139e6 and rows[0]["pod"] == ""
    assert warning.startswith("readme: skipped 6 malformed lines (first line 9: '...')") and rows[0]["error"] == warning
    temps = parse_exposition(text, ["DCGM_FI_DEV_MEMORY_TEMP"]).samples
    assert len(temps) == 2 and all(v == float(9223372036854775794) and is_blank(v, True) for _, _, v in temps)


def csv_fields(text: str) -> dict[str, str]:
    """Field -> Prometheus type of a dcgm-exporter counters CSV, commented-out rows included."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"#?\s*(DCGM_\w+)\s*,\s*(\w+)\s*,", line)
        if m:
            out[m.group(1)] = m.group(2)  # a later row (e.g. PROF_PCIE_TX_BYTES as a gauge) wins
    return out


def render_like_exporter(fields: dict[str, str], values: dict[str, float]) -> str:
    """An exposition as dcgm-exporter renders one (HELP, TYPE, one sample per GPU; label types become labels)."""
    lines = []
    for name, kind in fields.items():
        if kind == "label":
            continue
        lines += [f"# HELP {name} {name} help", f"# TYPE {name} {kind}"]
        for gpu in (0, 1):
            lines.append(f'{name}{{gpu="{gpu}",UUID="GPU-{gpu}",device="nvidia{gpu}",modelName="NVIDIA H200",'
                         f'hostname="node-a",DCGM_FI_DRIVER_VERSION="570.124.06"}} {values[name] + gpu}')
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("csv_name", CSVS)
def test_every_field_of_the_exporter_counter_lists(csv_name: str) -> None:
    fields = csv_fields(text_of(csv_name))
    assert len(fields) > 40 and fields["DCGM_FI_PROF_PCIE_TX_BYTES"] == "gauge"
    mapped = {f for f in fields if f in FIELDS}
    assert {"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_SM_CLOCK",
            "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE",
            "DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"} <= mapped
    values = {name: float(10 + 3 * i) for i, name in enumerate(fields)}
    rows, warning = rows_from_text(render_like_exporter(fields, values), "x", T0)
    assert warning == "" and [(r["host"], r["gpu"], r["gpu_model"]) for r in rows] == [
        ("node-a", 0, "NVIDIA H200"), ("node-a", 1, "NVIDIA H200")]
    for r in rows:
        for name in mapped:
            spec = FIELDS[name]
            if spec.column.startswith("_") or spec.rank > 0 and any(
                    FIELDS[o].column == spec.column and FIELDS[o].rank < spec.rank for o in mapped):
                continue  # helper column, or a fallback shadowed by the preferred field
            assert r[spec.column] == pytest.approx((values[name] + r["gpu"]) * spec.scale / spec.div), name
        v = {n: values[n] + r["gpu"] for n in fields}
        assert r["memory_total_bytes"] == (v["DCGM_FI_DEV_FB_USED"] + v["DCGM_FI_DEV_FB_FREE"]
                                           + v["DCGM_FI_DEV_FB_RESERVED"]) * MiB
        assert 0 <= r["gpu_util_ratio"] <= 1


# ----------------------------------------------------------------------------- HTTP targets

class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, bytes] = {}

    def do_GET(self) -> None:
        if self.path == "/slow":
            time.sleep(6.0)  # past the scraper's timeout, with room for a loaded machine
        body = self.routes.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # scraper stopped at max_body_bytes
            self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def server() -> Iterator[tuple[str, dict[str, bytes]]]:
    routes = {f"/{p.name}": p.read_bytes() for p in sorted(Path(shared_data("dcgm")).iterdir())}
    routes["/garbage"] = b"<html><body>502 Bad Gateway</body></html>\n\x00\xff binary junk\n"
    routes["/big"] = text_of(SYNTHETIC).encode() * 40
    routes["/slow"] = b""
    handler = type("H", (_Handler,), {"routes": routes})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", routes
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_scrape_real_http_targets_into_the_store(server: tuple[str, dict[str, bytes]], store: Any,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    base, routes = server
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    urls = [f"{base}/{SYNTHETIC}", f"{base}/{README}", *(f"{base}/{c}" for c in CSVS), f"{base}/garbage", dead,
            f"{base}/big", f"{base}/slow"]
    # 2 s: a 0.5 s timeout once timed out a local file target in a suite run on 2 busy CPUs
    scraper = create({"dcgm": {"urls": urls, "http": {"timeout_s": 2.0, "max_body_bytes": 256 * 1024}}}, Context())
    scraper.start()
    try:
        out = scraper.collect()
        cols = out[GPU_SAMPLES]
        rows = [dict(zip(cols, vals, strict=True)) for vals in zip(*cols.values(), strict=True)]
        got = [(r["host"], r["gpu"], r["state"]) for r in rows]
        assert got == [("gpu-node-17", 0, "ok"), ("gpu-node-17", 1, "ok"), ("127.0.0.1", 0, "ok"),
                       ("127.0.0.1", NO_GPU, "error"), ("127.0.0.1", NO_GPU, "error"), ("127.0.0.1", NO_GPU, "error"),
                       ("127.0.0.1", NO_GPU, "unreachable"), ("127.0.0.1", NO_GPU, "error"),
                       ("127.0.0.1", NO_GPU, "unreachable")]
        errors = [r["error"] for r in rows]
        assert all("\n" not in e for e in errors)
        assert errors[3].startswith(f"{base}/default-counters.csv: not Prometheus text (")
        assert errors[5].startswith(f"{base}/garbage: not Prometheus text (")
        assert errors[6].startswith(f"{dead}: scrape failed:") and "refused" in errors[6].lower()
        assert errors[7] == f"{base}/big: response exceeds max_body_bytes = 262144"
        assert errors[8].startswith(f"{base}/slow: scrape failed:") and "timed out" in errors[8]
        assert all(math.isnan(r["memory_used_bytes"]) for r in rows[3:])
        for table, c in out.items():
            store.insert(qualified(store, table), c)
        back = store.query(
            f"SELECT gpu, state, memory_used_bytes, pod, error = '' FROM {qualified(store, 'gpu_samples')} "
            "WHERE host = {h:String} ORDER BY gpu", {"h": "gpu-node-17"}).rows
        assert back == [(0, "ok", 77615.0 * MiB, "vllm-llama3-70b-0", 1), (1, "ok", 0.0, "", 1)]
        # the synthetic target goes away: its two known GPUs get state rows, the others are unaffected
        routes.pop(f"/{SYNTHETIC}")
        caplog.clear()
        with caplog.at_level("WARNING", logger="triscope.collectors.dcgm"):
            second = scraper.collect()[GPU_SAMPLES]
            third = scraper.collect()[GPU_SAMPLES]
        rows2 = [dict(zip(second, vals, strict=True)) for vals in zip(*second.values(), strict=True)]
        assert [(r["host"], r["gpu"], r["gpu_uuid"], r["state"]) for r in rows2[:3]] == [
            ("gpu-node-17", 0, "GPU-52e6b438-f2a7-269e-6513-0c5ca6a3a450", "unreachable"),
            ("gpu-node-17", 1, "GPU-128b2f33-d23f-892f-1818-95315d9dc9f8", "unreachable"),
            ("127.0.0.1", 0, "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52", "ok")]
        assert rows2[0]["error"] == f"{base}/{SYNTHETIC}: HTTP 404 Not Found"
        assert len(third["ts"]) == len(second["ts"])
        # one log line per new problem, not one per scrape
        assert [r.getMessage() for r in caplog.records] == [f"dcgm: {base}/{SYNTHETIC}: HTTP 404 Not Found"], \
            [r.getMessage() for r in caplog.records]
    finally:
        scraper.close()
        scraper.close()


def test_config_errors_are_one_line() -> None:
    with pytest.raises(ConfigError, match="urls is empty"):
        DcgmScraper({})
    with pytest.raises(ConfigError, match="not an http"):
        DcgmScraper({"dcgm": {"urls": ["file:///etc/passwd"]}})
    with pytest.raises(ConfigError, match="must be a list"):
        DcgmScraper({"dcgm": {"urls": "http://a:9400/metrics"}})
    with pytest.raises(ConfigError, match=r"\[dcgm.http\] max_body_bytes must be > 0"):
        DcgmScraper({"dcgm": {"urls": ["http://a:9400/metrics"], "http": {"max_body_bytes": 0}}})
    with pytest.raises(ConfigError, match=r"\[dcgm.http\] has unknown keys: timeout \(known: max_body_bytes, "):
        DcgmScraper({"dcgm": {"urls": ["http://a:9400/metrics"], "http": {"timeout": 1}}})
    with pytest.raises(InputError, match="no DCGM_FI_"):
        rows_from_text("# TYPE up gauge\nup 1\n", "h", T0)


def test_daemon_registry_loads_it() -> None:
    from triscope.daemon import COLLECTORS, resolve

    collector = resolve("dcgm", COLLECTORS, "collector")({"dcgm": {"urls": ["http://127.0.0.1:9400/metrics"]}},
                                                         Context())
    assert collector.name == "dcgm" and collector.interval_s == 5.0


def test_gpu_schema_v1_store_upgrades_to_v2(store: Any) -> None:
    """A store created before migration 2 gets the new columns; its old rows read '' there."""
    table = qualified(store, "gpu_samples")
    for view in ("gpu_samples_10s_mv", "gpu_samples_1m_mv"):  # a v1 store had no rollups
        store.command(f"DROP VIEW IF EXISTS {store.database}.{view}")
    store.command(f"DROP TABLE {table}")
    for sql in create_table_sql(GPU_SAMPLES, store.database, version=1):
        store.command(sql)
    store.insert(table, {"ts": ["2025-06-15 15:06:40"], "host": ["old"], "gpu": [0], "state": ["ok"]})
    store.command(f"ALTER TABLE {qualified(store, 'schema_migrations')} DELETE WHERE domain = 'gpu' AND version >= 2 "
                  "SETTINGS mutations_sync = 1")
    assert schema_versions(store)["gpu"] == 1
    assert migrate(store)["gpu"] == gpu_schema.MIGRATIONS[-1].version >= 2
    names = [r[0] for r in store.query(f"DESCRIBE TABLE {table}").rows]
    assert names == GPU_SAMPLES.column_names()
    assert store.query(f"SELECT host, pod, error FROM {table}").rows == [("old", "", "")]
    assert add_columns(GPU_SAMPLES, 2)(store.database, "")[0].startswith(
        f"ALTER TABLE {store.database}.gpu_samples ADD COLUMN IF NOT EXISTS `pod`")
