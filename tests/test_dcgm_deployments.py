"""dcgm-exporter deployment shapes: MIG, --use-old-namespace, behind Prometheus.

Inputs: lines quoted from users' dcgm-exporter output (tests/dcgm_samples.py, REAL_*) and SYNTHETIC
nodes rendered in dcgm-exporter's own label layout. The Prometheus tests run the real Prometheus
server (Debian's ``prometheus`` package) on 127.0.0.1: it scrapes exporters served here, with and
without ``honor_labels``, and triscope reads its ``/federate`` endpoint. Rows go through the store.
"""

from __future__ import annotations

import math
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, require_binary
from dcgm_samples import (
    REAL_MIG_A30_FB,
    REAL_MIG_A100_WHOLE,
    REAL_MIG_H100_PODS,
    REAL_OLD_NAMESPACE_MIG,
    REAL_POD_HOSTNAME_MIXED,
    REAL_UNMAPPED_ONLY,
    node,
)
from scrape_helpers import Route, raw_server

from triscope.collectors.dcgm import DcgmScraper, Identity, rows_from_text
from triscope.errors import ConfigError, InputError
from triscope.schema import encode_ts, qualified
from triscope.schema.gpu import GPU_SAMPLES

MiB = 1 << 20
T0 = 1_750_000_000_000_000_000
FED_MATCH = urllib.parse.urlencode({"match[]": '{__name__=~"DCGM_FI_.*"}'})


def _ident(row: dict[str, Any]) -> tuple[Any, ...]:
    return row["host"], row["gpu"], row["mig_instance"], row["mig_profile"], row["pod"], row["namespace"]


def _rows(columns: dict[str, list[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(columns, vals, strict=True)) for vals in zip(*columns.values(), strict=True)]


def test_mig_instances_are_rows_of_their_parent_gpu() -> None:
    """Each instance is a row (gpu = parent index, parent UUID) with its own pod; before, a MIG
    node gave one error row with gpu 65535 and pod-owned slices were dropped."""
    rows, warning = rows_from_text(REAL_MIG_H100_PODS, "10.0.0.9", T0)
    assert warning == ""
    assert [_ident(r) for r in rows] == [
        ("gsrh100-074", 0, "7", "1g.10gb", "text-embedding-predictor-00008-deployment-57946f6c67-vdtjl",
         "model-playground-stg"),
        ("gsrh100-074", 0, "8", "1g.10gb", "", ""),
        ("gsrh100-074", 0, "9", "1g.10gb", "tts-predictor-00011-deployment-5554f75554-8j8pl", "model-playground-stg")]
    assert {r["gpu_uuid"] for r in rows} == {"GPU-58e8f5ea-13cc-013a-d88f-2bcf5ae8bc77"}
    assert all(r["gpu_util_ratio"] == 0.0 and r["container"] in ("kserve-container", "") for r in rows)
    assert all(math.isnan(r["memory_used_bytes"]) for r in rows)  # FB fields absent on H100 instances (#512)

    a30, _ = rows_from_text(REAL_MIG_A30_FB, "x", T0)
    assert [(r["gpu"], r["mig_instance"]) for r in a30] == [(0, "3"), (0, "4"), (0, "5"), (0, "6"), (1, "3"), (1, "4")]
    assert all(r["memory_used_bytes"] == 3 * MiB and r["mig_profile"] == "1g.6gb" for r in a30)

    (whole,) = rows_from_text(REAL_MIG_A100_WHOLE, "x", T0)[0]
    assert (whole["mig_instance"], whole["mig_profile"], whole["sm_clock_hz"], whole["pod"]) == ("0", "7g.79gb",
                                                                                                 1410e6, "")


def test_use_old_namespace_labels_and_lowercase_names() -> None:
    rows, _ = rows_from_text(REAL_OLD_NAMESPACE_MIG, "a100-host", T0)
    assert [(r["host"], r["gpu"], r["gpu_uuid"], r["mig_instance"], r["mig_profile"]) for r in rows] == [
        ("a100-host", 0, "GPU-ed1353d6-52ba-8793-7230-4d5d3eb68167", "1", "3g.40gb"),
        ("a100-host", 0, "GPU-ed1353d6-52ba-8793-7230-4d5d3eb68167", "2", "4g.40gb"),
        ("a100-host", 1, "GPU-6043e4b2-feaa-8010-34c7-61d1a01576bb", "1", "3g.40gb")]
    # SYNTHETIC: the same line with the pod labels filled, as --use-old-namespace writes them for a workload
    used = REAL_OLD_NAMESPACE_MIG.splitlines()[0].replace(
        'container_name="",pod_name="",pod_namespace=""',
        'container_name="trainer",pod_name="trainer-0",pod_namespace="ml"')
    (row,) = rows_from_text(used + "\n", "h", T0)[0]
    assert (row["pod"], row["namespace"], row["container"]) == ("trainer-0", "ml", "trainer")


def test_exported_labels_win_and_the_exporters_own_pod_is_no_workload() -> None:
    """SYNTHETIC series shaped like a Prometheus query result of dcgm-exporter without honor_labels."""
    def series(g: int, extra: str = "") -> str:
        return ('DCGM_FI_DEV_FB_USED{DCGM_FI_DRIVER_VERSION="535.154.05",Hostname="node-1",UUID="GPU-1",'
                f'container="nvidia-dcgm-exporter",device="nvidia{g}",gpu="{g}",instance="10.0.3.7:9400",'
                f'job="nvidia-dcgm-exporter",namespace="gpu-operator",pod="nvidia-dcgm-exporter-7xk2p"{extra}}} 100\n')

    exported = ',exported_container="vllm",exported_namespace="inference",exported_pod="vllm-llama-0"'
    text = series(0, exported) + series(1)
    rows, _ = rows_from_text(text, "prometheus", T0)
    assert [(r["gpu"], r["pod"], r["namespace"], r["container"]) for r in rows] == [
        (0, "vllm-llama-0", "inference", "vllm"), (1, "", "", "")]
    # no Hostname label: the host part of Prometheus' instance label, not the URL of the Prometheus
    bare = text.replace('Hostname="node-1",', "")
    assert {r["host"] for r in rows_from_text(bare, "prometheus", T0)[0]} == {"10.0.3.7"}
    # a plain pod label whose name matches exporter_pods is never a workload (honor_labels on, GPU idle)
    honored = series(2)
    assert rows_from_text(honored, "p", T0)[0][0]["pod"] == ""
    assert rows_from_text(honored, Identity("p", exporter_pods=()), T0)[0][0]["pod"] == "nvidia-dcgm-exporter-7xk2p"


def test_host_override_and_host_label_per_target() -> None:
    """The #736 exporter runs without NODE_NAME: its hostname label is its pod name."""
    rows, _ = rows_from_text(REAL_POD_HOSTNAME_MIXED, "10.1.2.3", T0)
    assert {r["host"] for r in rows} == {"dcgm-exporter-wwwjh"}
    rows, _ = rows_from_text(REAL_POD_HOSTNAME_MIXED, Identity("10.1.2.3", host="gpu-node-5"), T0)
    assert [(r["host"], r["gpu"], r["mig_instance"], r["pod"]) for r in rows] == [
        ("gpu-node-5", 1, "", ""), ("gpu-node-5", 2, "3", "triton-server-f7cb5d77-95xcf")]
    assert math.isnan(rows[0]["memory_used_bytes"]) and math.isnan(rows[0]["memory_total_bytes"])  # FB_FREE only
    labelled = REAL_POD_HOSTNAME_MIXED.replace('hostname="dcgm-exporter-wwwjh"',
                                               'hostname="dcgm-exporter-wwwjh",node="gpu-node-6"')
    assert {r["host"] for r in rows_from_text(labelled, Identity("x", host_label="node"), T0)[0]} == {"gpu-node-6"}

    scraper = DcgmScraper({"dcgm": {"urls": ["http://10.1.2.3:9400/metrics",
                                             {"url": "http://10.1.2.4:9400/metrics", "host": "gpu-node-5"}]}})
    assert [t.host for t in scraper.targets] == ["10.1.2.3", "gpu-node-5"]
    with pytest.raises(ConfigError, match=r"urls entry .*hots.*\(keys: url, host, host_label\)"):
        DcgmScraper({"dcgm": {"urls": [{"url": "http://a:9400/metrics", "hots": "x"}]}})
    with pytest.raises(ConfigError, match="redirects must be one of"):
        DcgmScraper({"dcgm": {"urls": ["http://a:9400/metrics"], "http": {"redirects": "sometimes"}}})


def test_no_mapped_fields_is_its_own_error() -> None:
    with pytest.raises(InputError, match=r"^src: no mapped fields: 2 DCGM_FI_\* samples \(DCGM_FI_DEV_DEC_UTIL, "
                                         r"DCGM_FI_DEV_ENC_UTIL\) but none triscope maps"):
        rows_from_text(REAL_UNMAPPED_ONLY, "h", T0, "src")
    with pytest.raises(InputError, match="no DCGM_FI_"):
        rows_from_text("# TYPE up gauge\nup 1\n", "h", T0)


# ----------------------------------------------------------------------------- behind a real Prometheus

NODE_A = node("gpu-node-a", [
    {"gpu": 0, "uuid": "GPU-aaaa0000-0000-0000-0000-000000000000", "model": "NVIDIA H100 80GB HBM3",
     "pod": ("vllm-llama-0", "inference", "vllm"),
     "DCGM_FI_DEV_FB_USED": 71234, "DCGM_FI_DEV_FB_FREE": 9000, "DCGM_FI_DEV_GPU_UTIL": 93},
    {"gpu": 1, "uuid": "GPU-aaaa0000-0000-0000-0000-000000000001", "model": "NVIDIA H100 80GB HBM3",
     "DCGM_FI_DEV_FB_USED": 0, "DCGM_FI_DEV_FB_FREE": 80234, "DCGM_FI_DEV_GPU_UTIL": 0}])
"""SYNTHETIC values; the exporter runs with -k and NODE_NAME set (Hostname = node name)."""


def _prometheus_config(port: int) -> str:
    target = f"127.0.0.1:{port}"
    # Target labels as kube-prometheus' ServiceMonitor gives a dcgm-exporter pod.
    labels = ('{{namespace: gpu-operator, pod: "{pod}", container: nvidia-dcgm-exporter, '
              'service: nvidia-dcgm-exporter, endpoint: gpu-metrics}}')
    return f"""
global: {{scrape_interval: 1s, scrape_timeout: 1s}}
scrape_configs:
  - job_name: nvidia-dcgm-exporter
    honor_labels: false
    metrics_path: /node-a/metrics
    static_configs: [{{targets: ["{target}"], labels: {labels.format(pod="nvidia-dcgm-exporter-7xk2p")}}}]
  - job_name: dcgm-exporter-honored
    honor_labels: true
    metrics_path: /node-b/metrics
    static_configs: [{{targets: ["{target}"], labels: {labels.format(pod="nvidia-dcgm-exporter-q9w8e")}}}]
"""


@pytest.fixture()
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    binary = require_binary("prometheus")
    routes = {"/node-a/metrics": Route(body=NODE_A.encode()),
              "/node-b/metrics": Route(body=REAL_MIG_H100_PODS.encode())}
    with raw_server(routes) as exporters:
        (tmp_path / "prometheus.yml").write_text(_prometheus_config(exporters.port))
        port = free_port()
        log = tmp_path / "prometheus.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                     f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                    stdout=out, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:  # both jobs scraped at least once
                try:
                    with urllib.request.urlopen(f"{base}/federate?{FED_MATCH}", timeout=2) as resp:
                        text = resp.read().decode()
                    if 'job="dcgm-exporter-honored"' in text and 'job="nvidia-dcgm-exporter"' in text:
                        break
                except OSError:
                    pass
                assert proc.poll() is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, "Prometheus did not scrape the exporters within 30 s"
                time.sleep(0.2)
            yield base, proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_federation_of_a_kube_prometheus_style_prometheus(prometheus: tuple[str, Any], store: Any) -> None:
    base, _proc = prometheus
    url = f"{base}/federate?{FED_MATCH}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    # what Prometheus itself made of the exporter's labels (no honor_labels)
    assert 'exported_pod="vllm-llama-0"' in text and 'pod="nvidia-dcgm-exporter-7xk2p"' in text
    scraper = DcgmScraper({"dcgm": {"urls": [url], "http": {"timeout_s": 5.0}}})
    try:
        first = _rows(scraper.collect()[GPU_SAMPLES])
        t1 = time.time_ns()
        time.sleep(1.2)  # Prometheus scrapes every 1 s: the next federation has newer samples
        second = _rows(scraper.collect()[GPU_SAMPLES])
        third = scraper.collect().get(GPU_SAMPLES)  # at once: same samples again, not stored again
    finally:
        scraper.close()
    want = [("gpu-node-a", 0, "", "", "vllm-llama-0", "inference"), ("gpu-node-a", 1, "", "", "", ""),
            ("gsrh100-074", 0, "7", "1g.10gb", "text-embedding-predictor-00008-deployment-57946f6c67-vdtjl",
             "model-playground-stg"),
            ("gsrh100-074", 0, "8", "1g.10gb", "", ""),
            ("gsrh100-074", 0, "9", "1g.10gb", "tts-predictor-00011-deployment-5554f75554-8j8pl",
             "model-playground-stg")]
    assert [_ident(r) for r in first] == want
    assert all(r["state"] == "ok" and r["error"] == "" for r in first)
    a0 = first[0]
    assert (a0["memory_used_bytes"], a0["memory_total_bytes"], a0["gpu_util_ratio"], a0["container"]) == (
        71234 * MiB, (71234 + 9000) * MiB, pytest.approx(0.93), "vllm")
    # stamped with Prometheus' scrape time (whole milliseconds), not the collect time (nanoseconds)
    for r in first:
        assert r["ts"].endswith("000000") and r["ts"] <= encode_ts(t1), r["ts"]
    seen = {(_ident(r), r["ts"]) for r in first}
    assert not seen & {(_ident(r), r["ts"]) for r in second}, "a federated sample was stored twice"
    assert third is None or not seen & {(_ident(r), r["ts"]) for r in _rows(third)} and \
        not {(_ident(r), r["ts"]) for r in second} & {(_ident(r), r["ts"]) for r in _rows(third)}
    table = qualified(store, GPU_SAMPLES)
    store.insert(table, GPU_SAMPLES.columns_of(first + second))
    back = store.query(f"SELECT host, gpu, mig_instance, pod FROM {table} WHERE pod != '' "
                       "GROUP BY host, gpu, mig_instance, pod ORDER BY host, gpu, mig_instance").rows
    assert back == [("gpu-node-a", 0, "", "vllm-llama-0"),
                    ("gsrh100-074", 0, "7", "text-embedding-predictor-00008-deployment-57946f6c67-vdtjl"),
                    ("gsrh100-074", 0, "9", "tts-predictor-00011-deployment-5554f75554-8j8pl")]
