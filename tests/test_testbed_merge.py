"""Joining test bed runs made one policy at a time (``reports.testbed_merge``), on two real runs' documents."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from triscope_bed.reports.testbed_merge import MergeError, main, merge

DATA = Path(__file__).parent / "data" / "testbed"


def _doc(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def test_runs_of_the_same_arrivals_are_put_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "new" / "merged.json"  # its folder is made
    assert main([str(DATA / "pinned-leastconn.json"), f"{DATA / 'pinned-triscope-epp.json'}=new defaults",
                 "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    policies = merged["fleets"]["vllm"]["policies"]
    assert list(policies) == ["haproxy-leastconn", "triscope-epp (new defaults)"]
    # each policy keeps its own judgement and says on which bed it ran
    assert policies["haproxy-leastconn"]["goodput_qps"] == _doc("pinned-leastconn.json")["fleets"]["vllm"][
        "policies"]["haproxy-leastconn"]["goodput_qps"]
    assert all(p["engine_cores"] == "own" for p in policies.values())
    assert (merged["seed"], merged["scenario"]) == (618203, "pinned")
    assert (tmp_path / "new" / "merged.png").stat().st_size > 10_000
    table = capsys.readouterr().out
    assert "triscope-epp (new defaults)" in table and "peak QPS held" in table


def test_runs_of_other_arrivals_or_clashing_names_are_refused(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    lc, epp = _doc("pinned-leastconn.json"), _doc("pinned-triscope-epp.json")
    other = copy.deepcopy(epp)
    other["seed"] = 1
    with pytest.raises(MergeError, match="seed 1 differs"):
        merge([("", lc), ("b", other)])
    with pytest.raises(MergeError, match="appears twice"):
        merge([("", lc), ("", lc)])  # two rounds of one policy need labels
    assert list(merge([("r1", lc), ("r2", lc)])["fleets"]["vllm"]["policies"]) == ["haproxy-leastconn (r1)",
                                                                                  "haproxy-leastconn (r2)"]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main([str(bad), "--out", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("testbed_merge: ") and "\n" not in err
