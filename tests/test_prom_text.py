"""triscope's one exposition parser (``triscope.prom_text.scan``) is exact against prometheus-client's."""

from __future__ import annotations

import math

import pytest
from conftest import shared_data
from prometheus_client.parser import text_string_to_metric_families

from triscope.errors import InputError
from triscope.prom_text import parse_exposition, scan

EDGES = r'''# TYPE edge gauge
edge{a="q\"uote",b="back\\slash",c="new\nline"} 1
edge{a="nan"} NaN
edge{a="pinf"} +Inf
edge{a="ninf"} -Inf
edge{a="stamp"} 3 1700000000000
edge{a="exp"} 1.5e-3
edge{a="comma,brace}"} 2
edge 7
# TYPE h histogram
h_bucket{le="0.1"} 1
h_bucket{le="+Inf"} 4
h_sum 0.7
h_count 4
'''


def _samples(triples: list) -> list:
    return sorted((n, sorted(lab.items()), "NaN" if math.isnan(v) else repr(float(v))) for n, lab, v in triples)


@pytest.mark.parametrize("which", ["vllm", "edges"])
def test_scan_gives_exactly_prometheus_clients_samples(which: str) -> None:
    text = shared_data("vllm", "vllm_0.33_v1_two_engines.prom").read_text() if which == "vllm" else EDGES
    want = [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]
    parsed = scan(text)
    assert parsed.bad_lines == 0 and _samples(parsed.samples) == _samples(want) and len(want) > 10
    if which == "edges":
        assert dict(zip([tuple(lab.items()) for _, lab, _ in parsed.samples], parsed.stamps_ms, strict=True))[
            (("a", "stamp"),)] == 1700000000000
        assert parsed.samples[0][1] == {"a": 'q"uote', "b": "back\\slash", "c": "new\nline"}


def test_a_malformed_line_is_counted_by_scan_and_refused_by_parse_exposition() -> None:
    text = EDGES + 'edge{a="x" 1\nedge{a="y"} notanumber\n<html>\n'
    parsed = scan(text)
    assert (len(parsed.samples), parsed.bad_lines, parsed.bad_numbers) == (12, 3, [15, 16, 17])
    assert parsed.first_bad == "line 15: 'edge{a=\"x\" 1'"
    with pytest.raises(InputError, match=r"^src: not Prometheus text format: line 15: "):
        parse_exposition(text, "src")


def test_only_the_names_asked_for_and_their_upper_case_spelling() -> None:
    text = 'dcgm_fi_dev_gpu_temp{gpu="0"} 40\nDCGM_FI_DEV_X 1\nother{a="b"} 2\n'
    parsed = scan(text, {"DCGM_FI_DEV_GPU_TEMP"}, fold_case=True, count_prefix="DCGM_FI_")
    assert parsed.samples == [("DCGM_FI_DEV_GPU_TEMP", {"gpu": "0"}, 40.0)] and parsed.unmapped == {"DCGM_FI_DEV_X": 1}
    assert parse_exposition(text, names={"other"}) == {"other": [({"a": "b"}, 2.0)]}
