"""A trace produced here by torch.profiler (torch 2.13 CPU) goes through ingest and breakdown."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from kineto_helpers import complete_events, load_json

from triscope.analyzers.trace_breakdown import _load_steps, analyze_run
from triscope.collectors.kineto import ingest_trace
from triscope.schema import qualified

torch = pytest.importorskip("torch")


def _profile_small_model(out: Path, steps: int = 4) -> Path:
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(32, 64)
    target = torch.randint(0, 10, (32,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                schedule=torch.profiler.schedule(wait=0, warmup=1, active=steps),
                                on_trace_ready=lambda p: p.export_chrome_trace(str(out))) as prof:
        for _ in range(steps + 1):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            prof.step()
    return out


def test_real_torch_trace_round_trip(store, tmp_path: Path):
    trace = _profile_small_model(tmp_path / "cpu_model.json")
    doc = load_json(trace)
    expected = complete_events(doc)
    result = ingest_trace(store, trace, run_id="torch")
    assert result.status == "complete" and result.events == len(expected) and result.gpu_events == 0
    names = Counter(e["name"] for e in expected if e.get("cat") == "cpu_op")
    assert names, "the profiler recorded no CPU ops"
    for name, count in names.most_common(5):
        stored = store.query(f"SELECT count() FROM {qualified(store, 'trace_events')} WHERE kind = 'cpu_op' "
                             "AND name = {n:String}", {"n": name}).scalar()
        assert stored == count
    steps = _load_steps(store, "torch", [result.rank])[result.rank]
    assert [s[0] for s in steps] == sorted(s[0] for s in steps) and len(steps) == 4
    (rank,) = analyze_run(store, "torch")
    assert rank.whole.gpu_events == 0 and len(rank.steps) == 4
    if doc.get("baseTimeNanoseconds"):
        assert result.base_time_ns == int(doc["baseTimeNanoseconds"])
