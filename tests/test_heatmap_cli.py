"""``triscope heatmap`` end to end through ``triscope.cli.main`` on a seeded embedded store.

The CLI opens the same chDB directory and database as the ``store`` fixture (environment
overrides), so its outputs are compared with :func:`compute_heatmap` on the very same rows.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from test_heatmap import T0, WNS, _seed

from triscope.analyzers.heatmap import HeatmapSpec, compute_heatmap
from triscope.cli import main
from triscope.schema import encode_ts, qualified

FROM, TO = "2026-01-01T00:00:00Z", "2026-01-01T00:00:12Z"  # T0 .. T0 + 120 windows


@pytest.fixture()
def cli(store, monkeypatch: pytest.MonkeyPatch):
    """``main([...])`` against the fixture's store; returns (exit code, stdout, stderr)."""
    monkeypatch.delenv("TRISCOPE_CONFIG", raising=False)
    monkeypatch.setenv("TRISCOPE_STORE__PATH", store.path)
    monkeypatch.setenv("TRISCOPE_STORE__DATABASE", store.database)
    monkeypatch.setenv("COLUMNS", "200")

    def call(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
        code = main(["heatmap", *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return call


def test_json_npz_png_match_the_analyzer(store, cli, capsys, tmp_path: Path) -> None:
    _seed(store)
    expected = compute_heatmap(store, HeatmapSpec(), T0, T0 + 120 * WNS, top=4)
    npz, png = tmp_path / "h.npz", tmp_path / "h.png"
    code, out, err = cli(capsys, "--from", FROM, "--to", TO, "--json", "--top", "4", "--slice", "latency,qps",
                         "--npz", str(npz), "--png", str(png))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["shape"] == [32, 64, 128] and doc["start_ns"] == T0 and doc["end_ns"] == T0 + 120 * WNS
    assert doc["requests"] == expected.requests > 3000 and doc["unmatched_requests"] == expected.unmatched
    dense = np.zeros((32, 64, 128), dtype=np.uint64)
    for q, m, lat, n in doc["cells"]:
        dense[q, m, lat] = n
    np.testing.assert_array_equal(dense, expected.tensor)
    assert doc["patterns"] == expected.patterns and len(doc["patterns"]) == 4
    assert doc["slice"]["axes"] == ["latency", "qps"]
    assert np.array_equal(np.array(doc["slice"]["counts"]), expected.tensor.sum(axis=1).T)
    assert doc["bin_edges"]["memory"][:3] == [0, 200e6, 400e6] and len(doc["bin_edges"]["latency"]) == 129
    p95 = {(q, m): v for q, m, v in doc["p95_latency_seconds"]}
    assert p95 == {(int(q), int(m)): float(expected.p95_grid[q, m])
                   for q, m in np.argwhere(np.isfinite(expected.p95_grid))}

    with np.load(npz) as z:
        np.testing.assert_array_equal(z["tensor"], expected.tensor)
        np.testing.assert_allclose(z["qps_edges"], np.arange(33) * 5.0)
        np.testing.assert_allclose(z["memory_edges_bytes"], np.arange(65) * 200e6)
        np.testing.assert_allclose(z["latency_edges_seconds"], np.arange(129) * 0.01)
        np.testing.assert_array_equal(z["p95_latency_seconds"], expected.p95_grid)
        np.testing.assert_array_equal(z["slice"], expected.tensor.sum(axis=1).T)
        assert list(z["axes"]) == ["qps", "memory", "latency"] and int(z["start_ns"]) == T0

    data = png.read_bytes()
    assert len(data) > 10_000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    pixels = imread(png)  # decodes the whole image
    assert pixels.shape[0] > 500 and pixels.shape[1] > 500 and pixels.std() > 0


def test_table_filters_and_bins(store, cli, capsys) -> None:
    _seed(store, seed=2)
    code, out, err = cli(capsys, "--from", FROM, "--to", TO, "--top", "3")
    assert code == 0, err
    top = compute_heatmap(store, HeatmapSpec(), T0, T0 + 120 * WNS, top=3).patterns
    assert "typical load patterns" in out and "P95 latency" in out and "dominant modality" in out
    first = top[0]
    assert f"{first['requests']:,}" in out and f"{first['p95_latency_seconds'] * 1e3:.1f} ms" in out
    assert "requests left out: no GPU memory sample" in out  # h3 has none

    spec = HeatmapSpec(window_ms=200, qps_bin=10, qps_bins=8, memory_bin_bytes=1e9, memory_bins=16,
                       latency_bin_s=0.05, latency_bins=32)
    code, out, err = cli(capsys, "--from", FROM, "--to", TO, "--json", "--backend", "h1:8000", "--backend",
                         "h2:8000", "--model", "m-a", "--window-ms", "200", "--qps-bin", "10", "--memory-bin-mb",
                         "1000", "--latency-bin-ms", "50", "--shape", "8,16,32")
    assert code == 0, err
    doc = json.loads(out)
    ref = compute_heatmap(store, spec, T0, T0 + 120 * WNS, backends=["h1:8000", "h2:8000"], models=["m-a"])
    assert doc["shape"] == [8, 16, 32] and doc["requests"] == ref.requests > 0 and doc["unmatched_requests"] == 0
    assert sorted(doc["cells"]) == sorted([int(q), int(m), int(lat), int(ref.tensor[q, m, lat])]
                                          for q, m, lat in np.argwhere(ref.tensor))
    assert doc["spec"]["qps_bin"] == 10 and doc["spec"]["latency_bin_s"] == pytest.approx(0.05)


def test_config_env_and_since(store, cli, capsys, monkeypatch: pytest.MonkeyPatch,
                              tmp_path: Path) -> None:
    """``[heatmap]`` keys via environment overrides; ``--since`` ends now, so rows are inserted at now."""
    now = time.time_ns() // WNS * WNS
    store.insert(qualified(store, "requests"), {
        "ts": [encode_ts(now - 30 * WNS + i) for i in range(3)], "host": ["h1"] * 3, "backend": ["b"] * 3,
        "gpu": ["0"] * 3, "latency_seconds": [0.05, 0.25, 9.0], "modality": ["text"] * 3})
    store.insert(qualified(store, "gpu_samples"), {
        "ts": [encode_ts(now - 31 * WNS)], "host": ["h1"], "gpu": [0], "memory_used_bytes": [3.3e9]})
    monkeypatch.setenv("TRISCOPE_HEATMAP__LATENCY_BIN_S", "0.1")
    monkeypatch.setenv("TRISCOPE_HEATMAP__LATENCY_BINS", "8")
    png = tmp_path / "tiny.png"
    code, out, err = cli(capsys, "--since", "1m", "--json", "--png", str(png))
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # every cell holds 1 request: a flat colour scale
    doc = json.loads(out)
    # 3 requests in one window = 30 QPS -> bin 6; 3.3 GB -> bin 16; 0.05 s, 0.25 s, 9 s (clamped) -> 0, 2, 7
    assert sorted(doc["cells"]) == [[6, 16, 0, 1], [6, 16, 2, 1], [6, 16, 7, 1]]
    assert doc["shape"] == [32, 64, 8]
    code, out, err = cli(capsys, "--since", "1m", "--to", "2m")  # ends 2 minutes ago: nothing there
    assert code == 2 and "no requests with a latency" in err and err.count("\n") == 1
    code, out, err = cli(capsys, "--all", "--json", "--backend", "b")
    assert code == 0 and json.loads(out)["requests"] == 3


@pytest.mark.parametrize(("argv", "message"), [
    (["--from", TO, "--to", FROM], "empty time range"),
    (["--from", "2025-01-01T00:00:00Z", "--to", "2025-01-01T00:01:00Z"], "no requests with a latency"),
    (["--from", FROM, "--to", TO, "--backend", "nope"], "for backend nope"),
    (["--from", FROM, "--to", TO, "--backend", "h3:8000"], "had no GPU memory sample"),
    (["--since", "ten minutes"], "not a duration"),
    (["--from", "yesterday-ish"], "not an ISO-8601 time"),
    (["--since", "10m", "--from", FROM], "either --since or --from"),
    (["--all", "--since", "10m"], "--all cannot be combined"),
    (["--all", "--shape", "4,4"], "--shape needs three"),
    (["--all", "--qps-bin", "0"], "bin widths must be > 0"),
    (["--all", "--slice", "qps,qps"], "--slice needs two different axes"),
    (["--all", "--npz", "/nonexistent-dir/x.npz"], "output directory does not exist"),
])
def test_one_line_errors(store, cli, capsys, argv: list[str], message: str) -> None:
    _seed(store, seed=4, windows=20)
    code, out, err = cli(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err and err.startswith("triscope: error: ") and err.count("\n") == 1, err


def test_empty_store_and_bad_config(store, cli, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = cli(capsys, "--all")
    assert code == 2 and "the store has no requests" in err
    monkeypatch.setenv("TRISCOPE_HEATMAP__QPS_BINZ", "4")
    code, _, err = cli(capsys, "--all")
    assert code == 2 and "[heatmap] has unknown keys: qps_binz" in err and err.count("\n") == 1


def test_entry_point_subprocess(tmp_path: Path) -> None:
    """``python -m triscope heatmap`` in fresh processes on their own data path (no display)."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "TRISCOPE_STORE__PATH": str(tmp_path / "db"), "TRISCOPE_STORE__DATABASE": "hm",
           "PYTHONPATH": str(REPO / "tests"), "COLUMNS": "200"}
    env.pop("TRISCOPE_CONFIG", None)
    env.pop("DISPLAY", None)
    env.pop("MPLBACKEND", None)
    seed = ("from triscope.config import load_config; from triscope.store import open_store; "
            "from test_heatmap import _seed; s = open_store(load_config()); _seed(s, windows=30); s.close()")
    assert subprocess.run([sys.executable, "-c", seed], env=env, cwd=REPO, timeout=120).returncode == 0
    png = tmp_path / "out.png"
    run = subprocess.run([sys.executable, "-m", "triscope", "heatmap", "--all", "--png", str(png), "--top", "2"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "typical load patterns" in run.stdout and png.stat().st_size > 10_000
    bad = subprocess.run([sys.executable, "-m", "triscope", "heatmap", "--from", "2020-01-01", "--to", "2020-01-02"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("triscope: error: no requests") and bad.stdout == ""
