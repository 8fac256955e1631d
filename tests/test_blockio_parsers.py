"""Block-IO parsers on every sample in ../shared/data/ebpf, percentile interpolation, bad input."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
from conftest import shared_data

from triscope.collectors.blockio import AHEAD, BUFFERS, EbpfExporterCollector, WindowAssembler
from triscope.collectors.blockio.diskstats_parse import diskstats_delta, parse_diskstats
from triscope.collectors.blockio.parse import (
    Bucket,
    bpftrace_text_bucket,
    op_from_rwbs,
    parse_bcc_json,
    parse_biolatency_text,
    parse_bpftrace_json,
    parse_bpftrace_text,
    parse_ebpf_exporter,
    percentile,
)
from triscope.errors import InputError


def lines(name: str) -> list[str]:
    return shared_data("ebpf", name).read_text().splitlines()


def counts(bs: list[Bucket]) -> list[tuple[float, float, float]]:
    return [(b.lo, b.hi, b.count) for b in bs]


def test_percentile_interpolates_inside_bucket() -> None:
    bs = [Bucket(0, 10, 50), Bucket(10, 20, 50)]
    assert percentile(bs, 0.5) == pytest.approx(10.0)
    assert percentile(bs, 0.75) == pytest.approx(15.0)
    assert percentile(bs, 0.25) == pytest.approx(5.0)
    assert math.isnan(percentile([Bucket(0, 1, 0)], 0.5))
    # exact and open-ended buckets return their lower bound; negatives count as 0
    assert percentile([Bucket(-math.inf, 0, 3)], 0.5) == 0
    assert percentile([Bucket(4 << 20, math.inf, 2)], 0.99) == 4 << 20
    assert percentile([Bucket(1, 1, 2)], 0.99) == 1


def test_bpftrace_text_edge_buckets() -> None:
    assert bpftrace_text_bucket("[1K, 2K)  17 |@@ |") == Bucket(1024, 2048, 17)
    assert bpftrace_text_bucket("[4M, ...)  3 |@|") == Bucket(4 << 20, math.inf, 3)
    assert bpftrace_text_bucket("[0]  1 |@|") == Bucket(0, 0, 1)
    assert bpftrace_text_bucket("[1]  1 |@|") == Bucket(1, 1, 1)
    assert bpftrace_text_bucket("(..., 0)  1 |@|") == Bucket(-math.inf, 0, 1)
    assert bpftrace_text_bucket("@x[1]: 2") is None
    text = lines("local_bpftrace017_edge_buckets_and_json_types.txt")
    split = text.index("## json")
    parsed = parse_bpftrace_text(text[:split])
    h = parsed.hists["@h"][""]
    assert counts(h)[:3] == [(-math.inf, 0, 1), (0, 0, 1), (1, 1, 1)]
    assert counts(h)[-1] == (2048, 4096, 1)
    assert sum(b.count for b in h) == 4
    assert parsed.scalars["@x"]["1"] == 2 and parsed.scalars["@y"][""] == 1
    assert percentile(h, 0.5) == 0
    assert percentile(h, 0.99) == pytest.approx(2048 + 2048 * 0.96)
    # the -f json half of the same capture gives the same histogram
    hj = parse_bpftrace_json("\n".join(text[split + 1:]))["@h"][""]
    assert [b.count for b in hj] == [b.count for b in h]
    assert counts(hj)[:3] == [(-math.inf, 0, 1), (0, 0, 1), (1, 1, 1)]
    assert (hj[-1].lo, hj[-1].hi) == (2048, 4096)


def test_bpftrace_text_examples() -> None:
    ex = parse_bpftrace_text(lines("bpftrace_v0.17_biolatency_example.txt")).hists["@usecs"][""]
    assert sum(b.count for b in ex) == 883
    assert percentile(ex, 0.5) == pytest.approx(2048 + 2048 * (441.5 - 438) / 230)
    local = parse_bpftrace_text(lines("local_bpftrace017_text_block_io_hist.txt"))
    dev = local.hists["@usecs"]["254,0"]
    assert sum(b.count for b in dev) == 2108 and local.scalars == {}
    rq = parse_bpftrace_text(lines("local_bpftrace017_block_rq_hist.txt"))
    assert sum(b.count for b in rq.hists["@usecs"][""]) == 8069
    # '@usecs_by_dev[254, 0]: count 8069, average 29, total 237132' is a stats() line, not an error
    assert rq.errors == [] or all("usecs_by_dev" in e for e in rq.errors)
    for name in ("bpftrace_v0.17_biosnoop_example.txt", "bcc_biosnoop_example.txt"):
        assert parse_bpftrace_text(lines(name)).hists == {}


def test_bpftrace_json_files() -> None:
    one = parse_bpftrace_json(shared_data("ebpf", "bpftrace_repo_tests_hist.json").read_text())["@hist"][""]
    assert counts(one)[0] == (2, 4, 1) and counts(one)[-1] == (1024, 2048, 1)
    multi = parse_bpftrace_json(
        shared_data("ebpf", "bpftrace_repo_tests_hist_multiple_multiple_keys.json").read_text())["@"]
    assert set(multi) == {"bpftrace,2", "curl,3"}
    assert sum(b.count for b in multi["curl,3"]) == 2
    zero = parse_bpftrace_json(shared_data("ebpf", "bpftrace_repo_tests_hist_zero.json").read_text())
    assert zero["@hist"][""] == [] and math.isnan(percentile(zero["@hist"][""], 0.5))
    local = parse_bpftrace_json(shared_data("ebpf", "local_bpftrace017_json_block_io_hist.txt").read_text())
    dev = local["@usecs"]["254,0"]
    assert sum(b.count for b in dev) == 2147
    with pytest.raises(InputError, match="invalid JSON"):
        parse_bpftrace_json('{"type": "hist", "data": {')


def test_bcc_text_and_json() -> None:
    hs = parse_biolatency_text(lines("bcc_biolatency_example.txt"))
    first = hs[0]
    assert first.op == "all" and first.device == "" and first.count == 277
    assert (first.buckets[0].lo, first.buckets[0].hi) == (0, 2)
    ms = [h for h in hs if h.ts == "06:20:16"][0]
    assert ms.buckets[0].hi == 2000.0 and ms.count == 103  # msecs converted to usecs
    disks = {h.device: h.count for h in hs if h.device}
    assert disks == {"xvdb": 202, "xvdc": 201, "xvda1": 348}
    js = parse_bcc_json(lines("bcc_biolatency_example.txt"))
    assert js[0].count == 124 and js[0].ts == "2020-12-30 14:33:03"
    assert {h.op for h in js[1:5]} == {"write", "other"}
    assert [h.device for h in js if h.device] == ["sda"]  # b'sda' bytes literal
    assert js[-1].buckets[0] == Bucket(0, 2000, 11)
    with pytest.raises(InputError, match="bcc -j"):
        parse_bcc_json(["{'data': __import__('os').system('true')}"])
    # the percentiles tool prints other shapes; none of them is taken for a histogram
    assert parse_biolatency_text(lines("bcc_biolatpcts_example.txt")) == []


def test_libbpf_tools_variants() -> None:
    dt = parse_biolatency_text(lines("local_libbpf-tools_biolatency_-D_-T.txt"))
    assert len(dt) == 1 and dt[0].device == "vda" and dt[0].ts == "10:17:57" and dt[0].count == 3284
    f = parse_biolatency_text(lines("local_libbpf-tools_biolatency_-F.txt"))
    ops = [h.op for h in f]
    assert ops[:2] == ["write", "write"] and "discard" in ops
    assert f[1].count == 109 and f[-1].count == 4


def test_ebpf_exporter_prometheus() -> None:
    text = shared_data("ebpf", "ebpf_exporter_readme_bio_latency_metrics.prom").read_text()
    hs = {(h.device, h.op): h for h in parse_ebpf_exporter(text)}
    w = hs[("nvme0n1", "write")]
    assert w.count == 48
    assert percentile(w.buckets, 0.5) == pytest.approx(128 + 128 * 2 / 14)
    assert hs[("nvme1n1", "write")].count == 1
    with pytest.raises(InputError, match="ebpf_exporter"):
        parse_ebpf_exporter('x_bucket{le="1"} notanumber\n')
    # window rows come from deltas between two scrapes
    c = EbpfExporterCollector({"blockio": {"host": "h"}})
    assert c.rows_from_text(text, 1_000_000_000)["ts"] == []
    bumped = []
    for line in text.splitlines():  # 10 more writes on nvme0n1 in (128 us, 256 us]
        if line.startswith('ebpf_exporter_bio_latency_seconds_bucket{device="nvme0n1"'):
            le = line.split('le="')[1].split('"')[0]
            if float(le) >= 0.000256:
                name, value = line.rsplit(" ", 1)
                line = f"{name} {int(value) + 10}"
        bumped.append(line)
    rows = c.rows_from_text("\n".join(bumped) + "\n", 2_000_000_000)
    assert rows["ios"] == [10.0] and rows["device"] == ["nvme0n1"] and rows["window_seconds"] == [1.0]
    assert 128e-6 < rows["p50_seconds"][0] < 256e-6


def test_diskstats_two_snapshots() -> None:
    text = shared_data("ebpf", "local_diskstats.txt").read_text()
    section = text.split("## /sys/block")[0]
    before = parse_diskstats(section)
    vda = before["vda"]
    assert (vda.major, vda.minor, vda.reads, vda.read_ticks_ms, vda.writes) == (254, 0, 19751, 10609, 25304)
    assert vda.weighted_ticks_ms == 98348 and len(before) == 10
    f = section.splitlines()
    i = next(n for n, line in enumerate(f) if " vda " in line)
    p = f[i].split()
    p[3] = str(int(p[3]) + 100)    # reads
    p[6] = str(int(p[6]) + 50)     # read ticks ms
    p[7] = str(int(p[7]) + 20)     # writes
    p[10] = str(int(p[10]) + 80)   # write ticks ms
    p[13] = str(int(p[13]) + 4000)  # weighted ticks ms
    f[i] = " ".join(p)
    after = parse_diskstats("\n".join(f))
    out = {(d.device, d.op): d for d in diskstats_delta(before, after, 2.0)}
    r, w = out[("vda", "read")], out[("vda", "write")]
    assert r.ios == 100 and r.mean_seconds == pytest.approx(0.0005)
    assert w.ios == 20 and w.mean_seconds == pytest.approx(0.004)
    assert r.queue_depth == pytest.approx(2.0)
    assert math.isnan(out[("loop0", "read")].mean_seconds)
    with pytest.raises(InputError, match="diskstats"):
        parse_diskstats(" 254 0 vda 1 2 3\n")


def test_rwbs_ops() -> None:
    assert [op_from_rwbs(s) for s in ("R", "RA", "RS", "W", "WS", "FWFS", "D", "FN", "N")] == [
        "read", "read", "read", "write", "write", "write", "discard", "other", "other"]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_window_assembler_survives_garbage(fmt: str, caplog: pytest.LogCaptureFixture) -> None:
    """A bad line is one log line; the rest of the window still becomes rows."""
    if fmt == "text":
        stream = ["Attaching 4 probes...", "@usecs[254, 0, WS]: ", "[32, 64)  10 |@@@@|",
                  "[64, 128)  10 |@@@@|", "", "garbage ### line", "@usecs[254, 0, R]: ", "[0]  4 |@|",
                  "", "@lat_ns[254, 0, WS]: 1000000", "@qd_ns[254, 0]: 500000000", "triscope-window-end"]
    else:
        stream = ['{"type": "attached_probes", "data": {"probes": 4}}',
                  '{"type": "hist", "data": {"@usecs": {"254,0,WS": [{"min": 32, "max": 63, "count": 10},'
                  ' {"min": 64, "max": 127, "count": 10}], "254,0,R": [{"min": 0, "max": 0, "count": 4}]}}}',
                  '{"type": "hist", "data": {',
                  '{"type": "map", "data": {"@lat_ns": {"254,0,WS": 1000000}}}',
                  '{"type": "map", "data": {"@qd_ns": {"254,0": 500000000}}}',
                  '{"type": "printf", "data": "triscope-window-end\\n"}']
    a = WindowAssembler("h", fmt, 1.0)
    with caplog.at_level(logging.WARNING):
        for line in stream:
            a.feed(line + "\n", now_ns=5)
    assert a.errors == 1
    assert len([r for r in caplog.records if "bad bpftrace line" in r.getMessage()]) == 1
    rows = a.drain()
    by_op = {op: i for i, op in enumerate(rows["op"])}
    w, r = by_op["write"], by_op["read"]
    assert rows["ios"][w] == 20 and rows["ios"][r] == 4
    assert rows["p50_seconds"][w] == pytest.approx(64e-6)
    assert rows["mean_seconds"][w] == pytest.approx(1e-3 / 20)
    assert rows["p99_seconds"][r] == 0 and rows["mean_seconds"][r] == 0  # estimated from [0] bucket
    assert rows["queue_depth"][w] == pytest.approx(0.5)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_window_bounds_from_program_marks(fmt: str) -> None:
    """Marks carry CLOCK_MONOTONIC nsecs: the row's window is [start mark, end mark] on the wall clock."""
    if fmt == "text":
        stream = ["triscope-window-start 1000000000", "@usecs[254, 0, R]: ", "[128, 256)  4 |@@@@|", "",
                  "@lat_ns[254, 0, R]: 800000", "@qd_ns[254, 0]: 3000000000", "triscope-window-end 3000000000",
                  "@qd_ns[254, 0]: 500000000", "@usecs[254, 0, W]: ", "[64, 128)  1 |@|", "",
                  "triscope-window-end 3500000000"]
    else:
        stream = ['{"type": "printf", "data": "triscope-window-start 1000000000\\n"}',
                  '{"type": "hist", "data": {"@usecs": {"254,0,R": [{"min": 128, "max": 255, "count": 4}]}}}',
                  '{"type": "map", "data": {"@lat_ns": {"254,0,R": 800000}}}',
                  '{"type": "map", "data": {"@qd_ns": {"254,0": 3000000000}}}',
                  '{"type": "printf", "data": "triscope-window-end 3000000000\\n"}',
                  '{"type": "map", "data": {"@qd_ns": {"254,0": 500000000}}}',
                  '{"type": "hist", "data": {"@usecs": {"254,0,W": [{"min": 64, "max": 127, "count": 1}]}}}',
                  '{"type": "printf", "data": "triscope-window-end 3500000000\\n"}']
    a = WindowAssembler("h", fmt, 1.0)
    a.clock_offset_ns = 1_796_000_000_000_000_000
    for line in stream:
        a.feed(line + "\n", now_ns=123)
    assert a.errors == 0
    rows = a.drain()
    assert rows["op"] == ["read", "write"]
    assert rows["ts"] == ["2026-11-30 00:53:21.000000000", "2026-11-30 00:53:23.000000000"]
    assert rows["window_seconds"] == [2.0, 0.5]
    assert rows["queue_depth"] == [pytest.approx(1.5), pytest.approx(1.0)]
    assert rows["mean_seconds"][0] == pytest.approx(200e-6) and rows["ios"] == [4.0, 1.0]


def test_program_without_accounting_tracepoint() -> None:
    """Kernels before 6.5 lack block_io_start: the program drops those probes and every @acct use."""
    from triscope.collectors.blockio import bpftrace_program

    full, bare = bpftrace_program(2.4, True), bpftrace_program(2.4, False)
    assert "block_io_start" in full and "@acct" in full and "interval:ms:2400\n" in full
    assert "interval:ms:100\n" in bpftrace_program(0.01, False)
    assert "block_io_start" not in bare and "@acct" not in bare and "// acct" not in full + bare
    # the two accounting probes, the one-line `if` of the completion's start choice and the three
    # key counts of @acct go, braces and all
    assert bare.count("{") == bare.count("}") == full.count("{") - 6 == full.count("}") - 6
    assert "@keys[2]" not in bare and "@keys[3]" not in bare
    for i in range(BUFFERS):  # each window's maps go to set w % BUFFERS
        assert f"if ($b == {i}) {{ @usecs_{i}[$w, $ma, $mi, args->rwbs] = hist($lat / 1000);" in bare
    assert "$w = $n / 2400000000;" in full


def test_interval_flushes_only_sets_of_ended_windows() -> None:
    """The interval's print and clear run later, in bpftrace's user space: a set that the next
    window may already be counting into must not be among them. Evaluates the program's own
    conditions for every current set."""
    from triscope.collectors.blockio import bpftrace_program

    flushes = re.findall(r"if \(\((\d+) \+ (\d+) - \$cur\) % (\d+) > (\d+)\) \{ print\(@usecs_(\d+)\);",
                         bpftrace_program(1, True))
    assert len(flushes) == BUFFERS
    for cur in range(BUFFERS):
        flushed = {int(s) for i, b, m, ahead, s in flushes if (int(i) + int(b) - cur) % int(m) > int(ahead)}
        assert flushed == {(cur - k) % BUFFERS for k in range(1, BUFFERS - AHEAD)}, cur
        assert not flushed & {(cur + k) % BUFFERS for k in range(AHEAD + 1)}, cur
    assert AHEAD >= 1 and BUFFERS - 1 - AHEAD >= 2  # a late tick and a missed tick are both survived


def _render(fmt: str, events: list[tuple]) -> list[str]:
    """bpftrace output lines for ("mark", name, nsecs) / ("hist", map, key, [(lo, hi, n)]) / ("map", ...)."""
    out = []
    for ev in events:
        if ev[0] == "mark":
            out.append(f"{ev[1]} {ev[2]}" if fmt == "text" else
                       json.dumps({"type": "printf", "data": f"{ev[1]} {ev[2]}\n"}))
        elif ev[0] == "hist":
            _, name, key, buckets = ev
            if fmt == "text":
                out += [f"@{name}[{', '.join(map(str, key))}]: "]
                out += [f"[{lo}, {hi})  {n} |@@|" for lo, hi, n in buckets] + [""]
            else:
                out.append(json.dumps({"type": "hist", "data": {f"@{name}": {",".join(map(str, key)): [
                    {"min": lo, "max": hi - 1, "count": n} for lo, hi, n in buckets]}}}))
        else:
            _, name, key, value = ev
            out.append(f"@{name}[{', '.join(map(str, key))}]: {value}" if fmt == "text" else
                       json.dumps({"type": "map", "data": {f"@{name}": {",".join(map(str, key)): value}}}))
    return out


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_kernel_clock_windows_from_window_keys(fmt: str) -> None:
    """Maps keyed by window index become one row per window with exact kernel-clock bounds: the first
    clipped to when the probes went live, two windows printed at one (late) tick kept apart, and a
    window not yet over at a mark held until a later one."""
    events = [("mark", "triscope-window-start", 1_200_000_000),
              ("hist", "usecs_2", [2, 254, 0, "R"], [(128, 256, 6)]), ("map", "lat_ns_2", [2, 254, 0, "R"], 1_200_000),
              ("map", "qd_ns_2", [2, 254, 0], 300_000_000),
              ("mark", "triscope-window-end", 1_510_000_000),                      # w = 3 current: emits 2
              ("hist", "usecs_3", [3, 254, 0, "W"], [(64, 128, 2)]), ("map", "qd_ns_3", [3, 254, 0], 1_000_000_000),
              ("hist", "usecs_0", [4, 254, 0, "R"], [(256, 512, 4)]), ("map", "qd_ns_0", [4, 254, 0], 250_000_000),
              ("mark", "triscope-window-end", 2_505_000_000),                      # a tick late: emits 3 and 4
              ("hist", "usecs_2", [6, 254, 0, "R"], [(32, 64, 1)]),                # printed before its end
              ("mark", "triscope-window-end", 3_001_000_000),                      # w = 6 current: held
              ("mark", "triscope-window-end", 3_501_000_000),                      # now it is over
              ("hist", "usecs_3", [7, 254, 0, "W"], [(64, 128, 3)]), ("map", "qd_ns_3", [7, 254, 0], 50_000_000),
              ("mark", "triscope-window-final", 3_600_000_000)]                    # END: w = 7 so far
    a = WindowAssembler("h", fmt, 0.5)
    a.clock_offset_ns = 1_796_000_000_000_000_000
    seen = []  # rows made so far, after each mark
    for ev in events:
        for line in _render(fmt, [ev]):
            a.feed(line + "\n", now_ns=123)
        if ev[0] == "mark":
            seen.append(len(a.rows["ts"]))
    assert a.errors == 0
    rows = a.drain()
    assert rows["op"] == ["read", "write", "read", "read", "write"]
    assert seen == [0, 1, 3, 3, 4, 5]
    assert rows["ts"] == ["2026-11-30 00:53:21.200000000", "2026-11-30 00:53:21.500000000",
                          "2026-11-30 00:53:22.000000000", "2026-11-30 00:53:23.000000000",
                          "2026-11-30 00:53:23.500000000"]
    assert rows["window_seconds"] == [pytest.approx(0.3), 0.5, 0.5, 0.5, pytest.approx(0.1)]
    assert rows["queue_depth"][:3] == [pytest.approx(1.0), pytest.approx(2.0), pytest.approx(0.5)]
    assert rows["queue_depth"][4] == pytest.approx(0.5)
    assert rows["ios"] == [6.0, 2.0, 4.0, 1.0, 3.0] and rows["mean_seconds"][0] == pytest.approx(200e-6)
    assert a.raced == 1  # window 6, printed while it still counted (its clear may have dropped some)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_mark_read_late_flags_the_windows_its_clears_may_have_hit(fmt: str, caplog: pytest.LogCaptureFixture) -> None:
    """The interval of window ``cur`` clears the sets that windows ``cur + AHEAD + 1 ..
    cur + BUFFERS - 1`` count into next, and ran before its mark was read: a window among those
    that began before the read may have lost what it counted before the clear, though no print
    showed it counting. Marks read on time flag nothing; a saved file (no read time) neither."""
    w_ns = 500_000_000
    def window(w: int) -> list[tuple]:
        return [("hist", f"usecs_{w % BUFFERS}", [w, 254, 0, "R"], [(128, 256, 5)])]
    events: list[tuple[tuple, int | None]] = [(("mark", "triscope-window-live", 2 * w_ns), None)]
    for w in range(2, 16):
        events += [(ev, None) for ev in window(w)]
        read_at = (w + 1) * w_ns + 20_000_000  # read 20 ms after its tick: on time
        if w + 1 == 5:
            read_at = (5 + AHEAD + 2) * w_ns + 1  # the tick in window 5 read in window 9
        events.append((("mark", "triscope-window-end", (w + 1) * w_ns + 10_000_000), read_at))
    events.append((("mark", "triscope-window-final", 16 * w_ns), None))
    late = WindowAssembler("h", fmt, 0.5)
    saved = WindowAssembler("h", fmt, 0.5)
    with caplog.at_level(logging.WARNING):
        for ev, read_at in events:
            for line in _render(fmt, [ev]):
                late.feed(line + "\n", read_ns=read_at)
                saved.feed(line + "\n")
    assert late.errors == saved.errors == 0
    assert len(late.drain()["ts"]) == len(saved.drain()["ts"]) == 14
    # cleared by the tick in window 5: sets of windows 5 + 3 .. 5 + 5; begun before the read: 8, 9
    assert list(late.raced_windows) == [8, 9]
    assert late.raced == 2 and saved.raced == 0
    assert [r for r in caplog.records if "window 8 may miss requests" in r.getMessage()]
    idle = WindowAssembler("h", fmt, 0.5)  # an idle disk read 10 windows late for long: bounded memory
    for w in range(1, 2000):
        for line in _render(fmt, [("mark", "triscope-window-end", w * w_ns + 1)]):
            idle.feed(line + "\n", read_ns=(w + 10) * w_ns)
    assert len(idle._late) <= 10 + 2 * BUFFERS + 1 and idle.raced == 0  # the marks of lag + 2 x BUFFERS windows


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_stop_mark_ends_the_last_window(fmt: str) -> None:
    """bpftrace runs END well after it stopped counting: the stop probe's mark, not END's, ends
    the last window, and a window of a later process starts when that one went live."""
    events = [("mark", "triscope-window-start", 900_000_000),   # BEGIN: probes still attaching
              ("mark", "triscope-window-live", 1_000_000_000),    # counting starts
              ("hist", "usecs_2", [2, 254, 0, "R"], [(128, 256, 10)]), ("map", "qd_ns_2", [2, 254, 0], 200_000_000),
              ("mark", "triscope-window-stop", 1_200_000_000),
              ("mark", "triscope-window-end", 1_001_000_000),     # a tick still in w = 2: holds it
              ("mark", "triscope-window-end", 1_510_000_000),     # ticks go on after the stop, past w = 2
              ("mark", "triscope-window-final", 1_600_000_000),   # END, 0.4 s after the stop
              ("mark", "triscope-window-start", 1_700_000_000),   # the next process
              ("hist", "usecs_3", [3, 254, 0, "R"], [(128, 256, 4)]),
              ("mark", "triscope-window-final", 1_800_000_000)]   # stopped without the probe
    a = WindowAssembler("h", fmt, 0.5)
    a.clock_offset_ns = 0
    for ev in events:
        for line in _render(fmt, [ev]):
            a.feed(line + "\n", now_ns=123)
        if ev[1] == "triscope-window-stop":
            assert a.stop_seen and a.live_seen
    assert a.errors == 0 and not a.stop_seen and not a.live_seen
    rows = a.drain()
    assert rows["ios"] == [10.0, 4.0]
    assert rows["window_seconds"] == [pytest.approx(0.2), pytest.approx(0.1)]
    assert rows["queue_depth"][0] == pytest.approx(1.0), "200 ms of residence over the 0.2 s really counted"


def test_program_control_probe_only_with_a_magic() -> None:
    """The control probe comes last (it fires only once the block probes before it are attached)
    and gates completions on the live state; without syscall tracepoints neither is there."""
    from triscope.collectors.blockio import bpftrace_program

    plain, driven = bpftrace_program(1, True), bpftrace_program(1, True, control_magic=2_000_000_010)
    assert "@state" not in plain and "getpgid" not in plain
    assert "/args->pid == 2000000010 || args->pid == 2000000011/" in driven
    assert "/@start[args->dev, args->sector] > 0 && @state == 1/" in driven
    tracepoints = [ln for ln in driven.splitlines() if ln.startswith("tracepoint:")]
    assert tracepoints[-1] == "tracepoint:syscalls:sys_enter_getpgid"
    assert driven.count("{") == plain.count("{") + 4 and "// ctl" not in driven


def test_map_key_counts_are_read_from_both_formats() -> None:
    """``@keys`` (keys added to / removed from @start and @acct) is printed before every mark: the
    assembler keeps the last counts, and the fuller map's entries are what may fill."""
    from triscope.collectors.blockio import WindowAssembler, bpftrace_program

    program = bpftrace_program(1, True)
    interval = program[program.index("interval:ms:"):]
    assert "print(@keys);" in interval.split("printf(")[0], "the counts are printed before each mark"
    for probe, index in (("block_rq_issue", 0), ("block_io_start", 2)):
        body = program[program.index(f"tracepoint:block:{probe}"):].split("}\n", 1)[0]
        assert f"@keys[{index}] = count();" in body, body
    assert "@keys[2]" not in bpftrace_program(1, False), "no accounting map without block_io_start"

    text = WindowAssembler("h", "text", 1.0)
    for line in ("@keys[0]: 5000", "@keys[1]: 4990", "@keys[2]: 800", "@keys[3]: 200"):
        text.feed(line)
    assert text.errors == 0 and text.map_keys_held == 600
    js = WindowAssembler("h", "json", 1.0)
    js.feed('{"type": "map", "data": {"@keys": {"0": 9000, "1": 5000, "2": 12, "3": 12}}}')
    assert js.errors == 0 and js.map_keys_held == 4000
    js.feed('{"type": "map", "data": {"@keys": {"0": 9000, "1": 9061}}}')
    assert js.map_keys_held == 0, "counts read while probes run can cross: never below 0"


def test_skipped_probe_runs_are_read_per_process_and_logged_at_each_decade_and_full_maps_trigger_a_swap(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No BPF program in this process (or no process): None. The counts themselves come from the
    kernel (tests/test_blockio_bpftrace.py reads them from a live bpftrace, and swaps a live one);
    here a stand-in feeds the collector a rising count to check what it logs and when it swaps."""
    import os

    import triscope.collectors.blockio as blockio

    assert blockio.bpf_recursion_misses(os.getpid()) is None
    assert blockio.bpf_recursion_misses(2**22 + 7) is None
    for bad in (0, blockio.MAP_KEYS_MAX + 1, "many"):
        with pytest.raises(InputError, match="restart_at_map_keys"):
            blockio.BpftraceCollector({"blockio": {"restart_at_map_keys": bad}})

    class Alive:
        pid = 1

        def poll(self) -> None:
            return None

    collector = blockio.BpftraceCollector({"blockio": {"host": "h", "restart_at_map_keys": 2000}})
    collector._proc = Alive()  # type: ignore[assignment]
    swaps: list[int] = []
    monkeypatch.setattr(collector, "restart", lambda: swaps.append(collector.asm.map_keys_held))
    counts = iter([None, 0, 3, 5, 29, 31, 1999, 2000, 2100])
    monkeypatch.setattr(blockio.bpftrace, "bpf_recursion_misses", lambda pid: next(counts))
    held = iter([0, 40, 35, 1999, 2000, 2100, 1500, 2500, 30])  # @start entries printed before each collect
    seen = []
    with caplog.at_level("WARNING", logger="triscope.collectors.blockio"):
        for _ in range(9):
            collector.asm.feed(json.dumps({"type": "map", "data": {"@keys": {"0": 10_000 + next(held), "1": 10_000}}}))
            collector.collect()
            seen.append(collector.missed_probe_runs)
    assert seen == [0, 0, 3, 5, 29, 31, 1999, 2000, 2100]
    logged = [r.getMessage() for r in caplog.records]
    counted = [m for m in logged if "so far" in m]
    assert [m.split("skipped ")[1].split()[0] for m in counted] == ["3", "31", "1999"]
    assert all("not counted" in m for m in counted)
    assert swaps == [2000, 2100, 2500], "a swap whenever a request-start map holds restart_at_map_keys entries"
    assert sum("replacing the process" in m for m in logged) == 3


def test_failed_reads_are_counted_as_errors_and_logged_once(tmp_path, caplog) -> None:
    """A read that fails (here a missing file; EMFILE is the same OSError path) and a refused ebpf_exporter
    scrape are errors the collector loop counts on every tick, logged once per new message."""
    import logging
    import threading

    from conftest import free_port

    from triscope.collector_loop import CollectorLoop
    from triscope.collectors.blockio import create_diskstats, create_ebpf_exporter
    from triscope.component import Context

    class NoWriter:
        def submit(self, table, columns):  # pragma: no cover - nothing is handed over
            raise AssertionError("no rows expected")

    caplog.set_level(logging.WARNING)
    disk = create_diskstats({"blockio": {"interval_s": 1}}, Context())
    disk.path = str(tmp_path / "no-diskstats")
    ebpf = create_ebpf_exporter({"blockio": {"interval_s": 1, "url": f"http://127.0.0.1:{free_port()}/metrics"}},
                                Context())
    for collector in (disk, ebpf):
        loop = CollectorLoop(collector, NoWriter(), threading.Event())  # type: ignore[arg-type]
        for _ in range(5):
            loop.collect_once()
        assert loop.errors == 5 and loop.last_error, collector.name
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
