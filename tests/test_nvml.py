"""NVML sampler tests.

There is no GPU here, so most tests use a stand-in **at the nvidia-ml-py module boundary only**:
a module object holding every constant, ctypes struct and ``NVMLError`` subclass of the real
``pynvml`` (nvidia-ml-py) installed in the venv, whose library entry points (``nvmlInit``,
``nvmlDeviceGet*``, ``nvmlGpm*``) are replaced by functions over simulated GPUs. Like the real
bindings they raise ``pynvml.NVMLError`` (which maps the real error codes to the real subclasses,
e.g. ``NVMLError_GpuIsLost``), return the real ctypes structs (``c_nvmlMemory_v2_t``,
``c_nvmlUtilization_t``, ``c_nvmlFieldValue_t`` arrays with per-entry ``nvmlReturn``/``valueType``/
``timestamp``) and friendly objects for processes. The sampler code under test is unchanged.
The stand-in is ``triscope_bed.engines.nvml_standin`` (the test bed package, ``bed/``). The "no NVML library" test uses
the real module against this machine's missing libnvidia-ml.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import sys
import time
import types
from typing import Any

import pynvml as real
import pytest

from triscope.collectors.nvml import NvmlSampler
from triscope.schema import qualified
from triscope.schema.gpu import GPU_PROCESS_MEMORY, GPU_SAMPLES
from triscope_bed.engines.nvml_standin import Clock, FakeGpu, MiB, advance, standin


def sampler(nv: types.ModuleType, **cfg: Any) -> NvmlSampler:
    s = NvmlSampler({"nvml": {"host": "gpu-node-17", **cfg}}, nvml=nv)
    s.start()
    return s


def rows(cols: dict[str, list[Any]]) -> list[dict[str, Any]]:
    names = list(cols)
    return [dict(zip(names, vals, strict=True)) for vals in zip(*cols.values(), strict=True)]


def two_gpus() -> list[FakeGpu]:
    return [FakeGpu(), FakeGpu(uuid="GPU-128b2f33-d23f-892f-1818-95315d9dc9f8", used=0, util_gpu=0,
                               power_mw=71204, temp_c=29, reasons=0, processes=[])]


def test_standin_raises_real_error_classes() -> None:
    nv = standin(two_gpus())
    with pytest.raises(real.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()
    nv.nvmlInit()
    with pytest.raises(real.NVMLError_InvalidArgument) as exc:
        nv.nvmlDeviceGetHandleByIndex(7)
    assert exc.value.value == real.NVML_ERROR_INVALID_ARGUMENT == 2
    assert isinstance(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(0), real.nvmlMemory_v2),
                      real.c_nvmlMemory_v2_t)


def test_sample_maps_every_metric() -> None:
    gpus = two_gpus()
    nv = standin(gpus)
    s = sampler(nv)
    assert s.state == "ok" and len(s.devices) == 2
    first = s.sample_once(now_ns=1_750_000_000_000_000_000)
    r0 = rows(first[GPU_SAMPLES])[0]
    assert math.isnan(r0["pcie_tx_bytes_per_second"]) and math.isnan(r0["sm_occupancy_ratio"])  # no baseline yet
    advance(gpus, nv.clock, 0.1, pcie_tx_bps=2e9, pcie_rx_bps=5e8, nvlink_tx_bps=1024e6, nvlink_rx_bps=2048e6)
    out = s.sample_once(now_ns=1_750_000_000_100_000_000)
    g0, g1 = rows(out[GPU_SAMPLES])
    assert g0["ts"] == "2025-06-15 15:06:40.100000000"
    assert (g0["host"], g0["gpu"], g0["gpu_uuid"], g0["gpu_model"], g0["source"], g0["state"]) == (
        "gpu-node-17", 0, "GPU-52e6b438-f2a7-269e-6513-0c5ca6a3a450", "NVIDIA H100 80GB HBM3", "nvml", "ok")
    assert g0["memory_used_bytes"] == 40000 * MiB
    assert g0["memory_total_bytes"] == 81559 * MiB
    assert g0["memory_reserved_bytes"] == 553 * MiB
    assert g0["gpu_util_ratio"] == pytest.approx(0.97) and g0["memory_util_ratio"] == pytest.approx(0.41)
    assert g0["sm_clock_hz"] == 1980e6
    assert g0["power_watts"] == pytest.approx(512.331)
    assert g0["temperature_celsius"] == 58 and g0["clock_event_reasons"] == 0x20
    assert g0["pcie_tx_bytes_per_second"] == pytest.approx(2e9)
    assert g0["pcie_rx_bytes_per_second"] == pytest.approx(5e8)
    assert g0["nvlink_tx_bytes_per_second"] == pytest.approx(1024e6)
    assert g0["nvlink_rx_bytes_per_second"] == pytest.approx(2048e6)
    assert (g0["ecc_corrected_total"], g0["ecc_uncorrected_total"]) == (3, 0)
    assert g0["sm_active_ratio"] == pytest.approx(0.80)
    assert g0["sm_occupancy_ratio"] == pytest.approx(0.45)
    assert g0["dram_active_ratio"] == pytest.approx(0.30)
    assert math.isnan(g0["l2_bandwidth_ratio"])
    assert g1["gpu"] == 1 and g1["power_watts"] == pytest.approx(71.204) and g1["memory_used_bytes"] == 0
    # per-process memory on the first sample only (process_interval_s = 1 s of monotonic time)
    procs = rows(first[GPU_PROCESS_MEMORY])
    assert procs == [{"ts": "2025-06-15 15:06:40.000000000", "host": "gpu-node-17", "gpu": 0, "pid": 4242,
                      "process_name": "python3 -m vllm.entrypoints.openai.api_server",
                      "used_bytes": float(39000 * MiB)}]
    assert GPU_PROCESS_MEMORY not in out
    # batched: one field-values call per GPU and sample; power came from it, not nvmlDeviceGetPowerUsage
    assert nv.calls["nvmlDeviceGetFieldValues"] == 4
    assert nv.calls.get("nvmlDeviceGetPowerUsage", 0) == 0
    s.close()
    s.close()
    assert nv.state["init"] == 0


def test_gpu_lost_is_a_state_and_others_keep_sampling(caplog: pytest.LogCaptureFixture) -> None:
    gpus = two_gpus()
    nv = standin(gpus)
    s = sampler(nv, retry_s=3600)
    s.sample_once()
    gpus[1].lost = True
    with caplog.at_level(logging.WARNING, logger="triscope.collectors.nvml"):
        for _ in range(3):
            advance(gpus, nv.clock, 0.1)
            out = rows(s.collect()[GPU_SAMPLES])
            assert [(r["gpu"], r["state"]) for r in out] == [(0, "ok"), (1, "lost")]
            assert out[0]["memory_used_bytes"] == 40000 * MiB
            assert math.isnan(out[1]["memory_used_bytes"]) and out[1]["gpu_uuid"] == gpus[1].uuid
            assert out[0]["error"] == "" and out[1]["error"].startswith("NVML_ERROR_GPU_IS_LOST")
    assert s.state == "degraded" and "GPU 1 lost" in s.reason
    lost_lines = [r for r in caplog.records if "lost" in r.getMessage()]
    assert len(lost_lines) == 1
    # the lost GPU is not queried again until its retry time; then it comes back
    before = nv.calls["nvmlDeviceGetMemoryInfo"]
    s.sample_once()
    assert nv.calls["nvmlDeviceGetMemoryInfo"] == before + 1  # GPU 0 only
    gpus[1].lost = False
    s.devices[1].retry_at = 0.0
    out = rows(s.sample_once()[GPU_SAMPLES])
    assert [r["state"] for r in out] == ["ok", "ok"] and s.state == "ok"


def test_no_gpu_and_driver_not_loaded_are_states(caplog: pytest.LogCaptureFixture) -> None:
    s = sampler(standin([]))
    assert s.state == "no_gpu" and s.collect() == {}
    gpus = two_gpus()
    nv = standin(gpus, init_error=real.NVML_ERROR_DRIVER_NOT_LOADED)
    with caplog.at_level(logging.WARNING, logger="triscope.collectors.nvml"):
        s = sampler(nv, retry_s=0)
        assert s.state == "unavailable" and "Driver Not Loaded" in s.reason
        assert s.collect() == {} and s.collect() == {}  # retried, still failing: no new log line
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    nv.state["init_error"] = None  # driver loaded later: the next collect re-initializes
    out = s.collect()
    assert s.state == "ok" and len(out[GPU_SAMPLES]["ts"]) == 2


def test_real_module_without_library_is_unavailable(caplog: pytest.LogCaptureFixture) -> None:
    """Real nvidia-ml-py against this machine, which has no libnvidia-ml.so.1."""
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has an NVML library; tools/nvml_check.py covers real GPUs")
    with caplog.at_level(logging.WARNING, logger="triscope.collectors.nvml"):
        s = NvmlSampler({"nvml": {"retry_s": 3600}})
        s.start()
        assert s.collect() == {}
    assert s.state == "unavailable" and "NVML Shared Library Not Found" in s.reason
    assert len(caplog.records) == 1 and "\n" not in caplog.records[0].getMessage()
    s.close()
    s.close()


def test_missing_module_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    s = NvmlSampler({"nvml": {"retry_s": 0}})
    s.start()
    assert s.state == "unavailable" and "nvidia-ml-py is not installed" in s.reason
    assert s.collect() == {}


def test_unsupported_metrics_fall_back_or_go_nan() -> None:
    """A PCIe card on an old driver: no NVLink, no GPM, no instant power, no memory v2, no event reasons API."""
    gpu = FakeGpu(gpm_supported=False,
                  unsupported_fields={real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                                      real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, real.NVML_FI_DEV_POWER_INSTANT,
                                      real.NVML_FI_DEV_ECC_SBE_VOL_TOTAL, real.NVML_FI_DEV_ECC_DBE_VOL_TOTAL},
                  unsupported_calls={"nvmlDeviceGetUtilizationRates"})
    nv = standin([gpu])
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: (_ for _ in ()).throw(  # driver < 535
        real.NVMLError(real.NVML_ERROR_FUNCTION_NOT_FOUND))
    gpu.unsupported_calls.add("nvmlDeviceGetMemoryInfo_v2")
    s = sampler(nv)
    s.sample_once()
    advance([gpu], nv.clock, 0.2, pcie_tx_bps=1e6)
    r = rows(s.sample_once()[GPU_SAMPLES])[0]
    assert r["state"] == "ok"
    assert math.isnan(r["nvlink_tx_bytes_per_second"]) and math.isnan(r["sm_occupancy_ratio"])
    assert math.isnan(r["gpu_util_ratio"]) and math.isnan(r["ecc_corrected_total"])
    assert r["power_watts"] == pytest.approx(512.331)  # from nvmlDeviceGetPowerUsage
    assert r["memory_used_bytes"] == gpu.used + gpu.reserved and math.isnan(r["memory_reserved_bytes"])  # v1
    assert r["clock_event_reasons"] == 0x20  # via the throttle-reasons fallback
    assert r["pcie_tx_bytes_per_second"] == pytest.approx(1e6)
    # unsupported metrics are not asked again: only PCIe left in the field-values request
    assert [fid for fid, _ in s.devices[0].fields] == [real.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
                                                       real.NVML_FI_DEV_PCIE_COUNT_RX_BYTES]
    assert nv.calls["nvmlDeviceGetUtilizationRates"] == 1


def test_transient_error_is_nan_once_and_counter_wrap(caplog: pytest.LogCaptureFixture) -> None:
    gpu = FakeGpu(pcie_type=real.NVML_VALUE_TYPE_UNSIGNED_INT, pcie_tx=(1 << 32) - 1000)
    nv = standin([gpu])
    s = sampler(nv)
    s.sample_once()
    gpu.failing_once["nvmlDeviceGetTemperatureV"] = real.NVML_ERROR_TIMEOUT
    advance([gpu], nv.clock, 0.1, pcie_tx_bps=100_000)  # 10_000 bytes: wraps the 32-bit counter
    with caplog.at_level(logging.WARNING, logger="triscope.collectors.nvml"):
        r = rows(s.sample_once()[GPU_SAMPLES])[0]
    assert math.isnan(r["temperature_celsius"]) and r["state"] == "ok"
    assert r["pcie_tx_bytes_per_second"] == pytest.approx(100_000)
    assert len(caplog.records) == 1 and "Timeout" in caplog.records[0].getMessage()
    advance([gpu], nv.clock, 0.1)
    assert rows(s.sample_once()[GPU_SAMPLES])[0]["temperature_celsius"] == 58


def test_rows_round_trip_through_the_store(store: Any) -> None:
    gpus = two_gpus()
    gpus[0].processes.append((777, None))  # WDDM-style "not available" memory -> NaN
    nv = standin(gpus)
    s = sampler(nv, ecc="aggregate")
    first = s.sample_once(now_ns=1_750_000_000_000_000_000)
    advance(gpus, nv.clock, 0.1, pcie_tx_bps=3e9)
    second = s.sample_once(now_ns=1_750_000_000_100_000_000)
    for batch in (first, second):
        for table, cols in batch.items():
            store.insert(qualified(store, table), cols)
    got = store.query(
        f"SELECT gpu, toString(ts), state, memory_used_bytes, pcie_tx_bytes_per_second, ecc_corrected_total, "
        f"sm_occupancy_ratio, clock_event_reasons FROM {qualified(store, 'gpu_samples')} "
        f"WHERE isFinite(pcie_tx_bytes_per_second) ORDER BY gpu").rows
    assert got[0][:3] == (0, "2025-06-15 15:06:40.100000000", "ok")
    assert got[0][3] == 40000 * MiB and got[0][4] == pytest.approx(3e9) and got[0][5] == 103
    assert got[0][6] == pytest.approx(0.45, rel=1e-6) and got[0][7] == 0x20
    assert [r[0] for r in got] == [0, 1]
    # every column of every row comes back as sampled (NaN stays NaN; the JSON result renders it as null,
    # so compare through query_columns, which keeps floats as floats)
    for schema in (GPU_SAMPLES, GPU_PROCESS_MEMORY):
        table = schema.name
        sent = {c: first[schema][c] + second.get(schema, {}).get(c, []) for c in schema.column_names()}
        assert set(first[schema]) == set(schema.column_names())
        select = ", ".join("toString(ts) AS ts" if c == "ts" else f"`{c}`" for c in schema.column_names())
        back = store.query_columns(f"SELECT {select} FROM {qualified(store, table)} ORDER BY ts, gpu"
                                   + (", pid" if table == "gpu_process_memory" else ""))
        n = len(sent["ts"])
        assert len(back["ts"]) == n and n > 0
        key = ["ts", "gpu"] + (["pid"] if table == "gpu_process_memory" else [])
        order = sorted(range(n), key=lambda i: tuple(sent[k][i] for k in key))
        sent = {c: [v[i] for i in order] for c, v in sent.items()}
        for c in schema.column_names():
            for i in range(n):
                want, got_v = sent[c][i], back[c][i]
                if isinstance(want, float) and math.isnan(want):
                    assert math.isnan(float(got_v)), (table, c, i)
                elif isinstance(want, float):
                    assert float(got_v) == pytest.approx(want, rel=1e-6), (table, c, i)
                else:
                    assert (got_v.decode() if isinstance(got_v, bytes) else got_v) == want, (table, c, i)
    procs = store.query(f"SELECT pid, process_name, isNaN(used_bytes), used_bytes "
                        f"FROM {qualified(store, 'gpu_process_memory')} ORDER BY pid").rows
    assert procs[0][:3] == (777, "", 1)
    assert procs[1] == (4242, "python3 -m vllm.entrypoints.openai.api_server", 0, 39000.0 * MiB)


def _nvml_check() -> types.ModuleType:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "nvml_check.py"
    spec = importlib.util.spec_from_file_location("nvml_check", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class WallClock(Clock):
    """Field timestamps that follow real time (the tool samples in real time)."""

    @property  # type: ignore[override]
    def us(self) -> int:
        return time.time_ns() // 1000

    @us.setter
    def us(self, value: int) -> None:
        pass


def test_nvml_check_tool_without_gpu_prints_one_line() -> None:
    """tools/nvml_check.py as a real subprocess on this machine (no NVML library)."""
    import subprocess
    from pathlib import Path

    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has an NVML library")
    tool = Path(__file__).resolve().parent.parent / "tools" / "nvml_check.py"
    res = subprocess.run([sys.executable, str(tool)], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        "no GPU: NVML state unavailable: nvmlInit failed: NVML Shared Library Not Found (code 12)"]
    assert res.stderr == ""
    res = subprocess.run([sys.executable, str(tool), "--require-gpu"], capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 2


def test_nvml_check_tool_reports_metrics_and_memory_mismatch(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The tool's main() over the stand-in module; nvidia-smi readings are injected (no GPU here)."""
    tool = _nvml_check()
    assert tool.parse_smi_memory("index, memory.used [MiB]\n0, 40000 MiB\n1, [N/A]\n2, 17\n") == {0: 40000.0, 2: 17.0}
    gpus = two_gpus()
    gpus[1].unsupported_calls.add("nvmlDeviceGetUtilizationRates")
    smi = {0: 40000.0, 1: 0.0}
    monkeypatch.setattr(tool, "smi_memory_used", lambda: dict(smi))
    rc = tool.main(["--seconds", "0.25", "--interval", "0.05"], nvml=standin(gpus, clock=WallClock()))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "NVML: 2 GPU(s), state ok" in out and "memory cross-check: ok" in out
    gpu1 = out.split("GPU 1 ")[1]
    assert "gpu_util_ratio                 unsupported" in gpu1
    assert "memory_total_bytes             supported    8.55208e+10" in gpu1
    assert "pcie_tx_bytes_per_second       supported    0" in gpu1  # counters did not move
    assert "util=unsupported" in gpu1 and "memory=GetMemoryInfo(v2)" in gpu1 and "gpm=yes" in gpu1
    assert "power=FieldValues(POWER_INSTANT)" in gpu1
    assert "l2_bandwidth_ratio             unsupported" in gpu1
    assert "gpu_util_ratio                 supported    0.97" in out.split("GPU 1 ")[0]
    # an old-driver nvidia-smi that counts the reserved memory as used also matches
    smi[0] = 40000.0 + 553
    assert tool.main(["--seconds", "0.1"], nvml=standin(two_gpus())) == 0
    smi[0] = 30000.0  # 10 GB off: a mismatch
    rc = tool.main(["--seconds", "0.1"], nvml=standin(two_gpus()))
    out = capsys.readouterr().out
    assert rc == 1 and "MISMATCH GPU 0: NVML memory used 40000 MiB" in out and "FAILED" in out
    smi.pop(1)
    assert tool.main(["--seconds", "0.1"], nvml=standin(two_gpus())) == 1
    assert "GPU 1: nvidia-smi did not report it" in capsys.readouterr().out
