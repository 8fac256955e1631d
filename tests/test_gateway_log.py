"""The gateway access log's summary (``triscope_bed.peers.gateway_log``) on written records; the live log is checked
through real Envoy in tests/test_epp_gateway.py and tests/test_testbed.py."""

from __future__ import annotations

import json
from pathlib import Path

from triscope.exporters.extproc import ACCESS_LOG_FORMAT
from triscope_bed.peers.gateway_log import SLOW_PICK_MS, read_access_log, summarize


def record(start: float, upstream: str | None, pick: float | None, upstream_ms: float | None, code: int = 200,
           flags: str = "-") -> dict:
    return {"start": f"{start:.3f}", "code": code, "flags": flags, "upstream": upstream, "pick_ms": pick,
            "upstream_ms": upstream_ms, "answer_ms": 1 if upstream_ms is not None else None,
            "duration_ms": (pick or 0) + (upstream_ms or 0)}


def test_the_log_format_names_every_stage_the_summary_reads() -> None:
    assert {"upstream", "code", "flags", "start", "pick_ms", "upstream_ms", "answer_ms", "duration_ms"} <= set(
        ACCESS_LOG_FORMAT)
    assert ACCESS_LOG_FORMAT["pick_ms"] == "%COMMON_DURATION(DS_RX_END:US_TX_BEG:ms)%"


def test_routes_outcomes_and_stages_are_summarized(tmp_path: Path) -> None:
    names = {"127.0.0.1:1": "b0", "127.0.0.1:2": "b1"}
    records = [record(100.0 + i, "127.0.0.1:1" if i % 3 else "127.0.0.1:2", 2.0 + i, 50.0) for i in range(9)]
    records.append(record(103.5, "127.0.0.1:1", 2500.0, None, 504, "UMSDR"))  # the picker's stall
    records.append(record(104.0, None, None, None, 0, "DC"))  # the client hung up before a pick
    path = tmp_path / "access.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + '\n{"start": "10')  # a line cut at the stop
    got = summarize(read_access_log(path), names)
    assert got["requests"] == 11
    assert got["routed"] == {"b0": 7, "b1": 3}
    assert got["outcomes"] == {"200": 9, "504 UMSDR": 1, "0 DC": 1}
    assert got["slow_picks"] == 1 and SLOW_PICK_MS < 2500.0
    assert got["slowest_picks"] == [{"t_s": 3.5, "pick_ms": 2500.0, "upstream": "b0", "code": 504}]
    pick = got["stages_ms"]["pick_ms"]
    assert pick["max"] == 2500.0 and pick["p50"] == 6.0  # 2, 3, ..., 10, 2500: the 5th of 10 (nearest rank)
    assert got["stages_ms"]["upstream_ms"] == {"p50": 50.0, "p99": 50.0, "max": 50.0}


def test_a_missing_log_is_an_empty_summary(tmp_path: Path) -> None:
    got = summarize(read_access_log(tmp_path / "none.jsonl"))
    assert got["requests"] == 0 and got["routed"] == {} and got["stages_ms"]["pick_ms"]["p50"] is None
