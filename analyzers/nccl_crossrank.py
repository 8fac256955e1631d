"""Cross-rank views of ``nccl_ops``: the straggler of each collective and Flight Recorder checks.

A collective is one (run, source, communicator, collective, seq) seen by two or more ranks.
Its straggler is the rank that arrived last (latest start / creation time); every other rank
waited for it roughly ``lateness`` = latest - earliest arrival. Flight Recorder dumps are also
checked for pending (never completed) collectives and for ranks whose sequence of collectives
disagrees: a rank that stopped early (the others moved on to later seq numbers), or the same seq
recorded as a different collective or size on different ranks.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from triscope.schema import NCCL_OPS, qualified
from triscope.store.base import Store


@dataclass
class CollectiveArrival:
    """One collective across ranks."""

    run_id: str
    source: str
    comm_id: str
    collective: str
    seq: int
    host_side: bool
    ranks: list[int]
    arrival_offsets_seconds: list[float]  # per rank, after the earliest arrival
    durations_seconds: list[float]
    straggler_rank: int
    lateness_seconds: float
    longest_wait_rank: int
    longest_wait_seconds: float


@dataclass
class StragglerReport:
    """Stragglers of a time range / run."""

    collectives: list[CollectiveArrival] = field(default_factory=list)
    min_lateness_seconds: float = 0.0

    def by_rank(self) -> list[dict[str, Any]]:
        """Per straggler rank: how often it was last and the total wait it caused."""
        count: Counter[tuple[str, int]] = Counter()
        total: dict[tuple[str, int], float] = defaultdict(float)
        worst: dict[tuple[str, int], float] = defaultdict(float)
        for c in self.collectives:
            if c.lateness_seconds >= self.min_lateness_seconds:
                key = (c.run_id, c.straggler_rank)
                count[key] += 1
                total[key] += c.lateness_seconds
                worst[key] = max(worst[key], c.lateness_seconds)
        groups: Counter[str] = Counter(c.run_id for c in self.collectives)
        out = [{"run_id": run, "rank": rank, "times_last": n, "collectives": groups[run],
                "total_lateness_seconds": total[(run, rank)], "max_lateness_seconds": worst[(run, rank)]}
               for (run, rank), n in count.items()]
        return sorted(out, key=lambda d: (-d["total_lateness_seconds"], d["rank"]))

    def to_json(self, limit: int = 20) -> dict[str, Any]:
        worst = sorted(self.collectives, key=lambda c: -c.lateness_seconds)[:limit]
        return {"min_lateness_seconds": self.min_lateness_seconds, "collectives": len(self.collectives),
                "by_rank": self.by_rank(), "worst": [asdict(c) for c in worst]}


def _range_sql(start_ns: int | None, end_ns: int | None) -> str:
    sql = ""
    if start_ns is not None:
        sql += " AND ts >= fromUnixTimestamp64Nano({start:Int64})"
    if end_ns is not None:
        sql += " AND ts < fromUnixTimestamp64Nano({end:Int64})"
    return sql


def stragglers(store: Store, run_ids: list[str] | None = None, start_ns: int | None = None,
               end_ns: int | None = None, min_lateness_seconds: float = 0.001,
               sources: tuple[str, ...] = ("kineto", "flight_recorder"),
               hosts: list[str] | None = None) -> StragglerReport:
    """Latest arrival per collective seen by >= 2 ranks (p2p ops are left out)."""
    params: dict[str, Any] = {"sources": list(sources), "start": start_ns or 0, "end": end_ns or 0}
    where = "source IN {sources:Array(String)} AND seq >= 0 AND is_p2p = 0 AND rank >= 0"
    if hosts:
        where += " AND host IN {hosts:Array(String)}"
        params["hosts"] = list(hosts)
    if run_ids:
        where += " AND run_id IN {runs:Array(String)}"
        params["runs"] = list(run_ids)
    where += _range_sql(start_ns, end_ns)
    res = store.query(
        "SELECT run_id, source, comm_id, collective, seq, device < 0 AS host_side, "
        "groupArray(rank), groupArray(toUnixTimestamp64Nano(ts)), groupArray(duration_seconds) "
        f"FROM {qualified(store, NCCL_OPS)} WHERE {where} "
        "GROUP BY run_id, source, comm_id, collective, seq, host_side HAVING uniqExact(rank) >= 2 "
        "ORDER BY run_id, source, comm_id, collective, seq", params)
    report = StragglerReport(min_lateness_seconds=min_lateness_seconds)
    for run_id, source, comm, coll, seq, host_side, ranks, ts, durs in res.rows:
        first: dict[int, tuple[int, float]] = {}
        for r, t, d in zip(ranks, ts, durs, strict=True):
            if r not in first or t < first[r][0]:
                first[int(r)] = (int(t), float(d) if d is not None else float("nan"))
        order = sorted(first)
        arrivals = [first[r][0] for r in order]
        earliest, latest = min(arrivals), max(arrivals)
        last_rank = order[arrivals.index(latest)]
        early_rank = order[arrivals.index(earliest)]
        durations = [first[r][1] for r in order]
        report.collectives.append(CollectiveArrival(
            run_id=run_id, source=source, comm_id=comm, collective=coll, seq=int(seq), host_side=bool(host_side),
            ranks=order, arrival_offsets_seconds=[(a - earliest) / 1e9 for a in arrivals],
            durations_seconds=durations, straggler_rank=last_rank, lateness_seconds=(latest - earliest) / 1e9,
            longest_wait_rank=early_rank, longest_wait_seconds=(latest - earliest) / 1e9,
        ))
    return report


def flight_recorder_check(store: Store, run_ids: list[str] | None = None, start_ns: int | None = None,
                          end_ns: int | None = None) -> list[dict[str, Any]]:
    """Per Flight Recorder run and process group: pending collectives and sequence mismatches.

    With a time range, every Flight Recorder run with an entry in it is checked (all its entries).
    """
    params: dict[str, Any] = {"start": start_ns or 0, "end": end_ns or 0}
    where = "source = 'flight_recorder' AND is_p2p = 0"
    if run_ids:
        where += " AND run_id IN {runs:Array(String)}"
        params["runs"] = list(run_ids)
    if start_ns is not None or end_ns is not None:
        where += (f" AND run_id IN (SELECT DISTINCT run_id FROM {qualified(store, NCCL_OPS)} "
                  f"WHERE source = 'flight_recorder'{_range_sql(start_ns, end_ns)})")
    rows = store.query(
        "SELECT run_id, comm_id, pg_desc, rank, seq, collective, op_name, msg_bytes, state, "
        "JSONExtractBool(detail_json, 'pending') AS pending, toUnixTimestamp64Nano(ts) "
        f"FROM {qualified(store, NCCL_OPS)} WHERE {where} ORDER BY run_id, comm_id, seq, rank", params).rows
    groups: dict[tuple[str, str], list[tuple[Any, ...]]] = defaultdict(list)
    for r in rows:
        groups[(r[0], r[1])].append(r)
    out = []
    for (run_id, comm), items in groups.items():
        ranks = sorted({int(r[3]) for r in items})
        last_seq = {rank: max(int(r[4]) for r in items if r[3] == rank) for rank in ranks}
        top = max(last_seq.values())
        behind = [{"rank": rank, "last_seq": s, "missing": top - s} for rank, s in last_seq.items() if s < top]
        by_seq: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
        for r in items:
            by_seq[int(r[4])].append(r)
        mismatches = []
        for seq, entries in sorted(by_seq.items()):
            kinds = {(e[5], None if e[7] != e[7] else e[7]) for e in entries}
            if len(kinds) > 1:
                mismatches.append({"seq": seq, "per_rank": {int(e[3]): {"collective": e[6], "msg_bytes": e[7]}
                                                            for e in entries}})
        pending = [{"rank": int(r[3]), "seq": int(r[4]), "collective": r[6], "state": r[8]}
                   for r in items if r[9]]
        out.append({"run_id": run_id, "comm_id": comm, "pg_desc": items[0][2], "ranks": ranks,
                    "last_seq": {str(k): v for k, v in last_seq.items()}, "ranks_behind": behind,
                    "mismatches": mismatches, "pending": pending,
                    "ok": not (behind or mismatches or pending)})
    return out



def nothing_to_compare(store: Store, report: StragglerReport, run_ids: list[str] | None = None,
                       sources: tuple[str, ...] = ("kineto", "flight_recorder")) -> list[str]:
    """One line per reason the straggler report is empty or all on time, for a reader; none when it has stragglers."""
    if report.by_rank():
        return []
    params: dict[str, Any] = {"sources": list(sources)}
    where = "source IN {sources:Array(String)} AND rank >= 0"
    if run_ids:
        where += " AND run_id IN {runs:Array(String)}"
        params["runs"] = list(run_ids)
    rows = store.query(
        "SELECT run_id, countIf(is_p2p = 0), arraySort(groupUniqArrayIf(rank, is_p2p = 0)), countIf(is_p2p = 1) "
        f"FROM {qualified(store, NCCL_OPS)} WHERE {where} GROUP BY run_id ORDER BY run_id", params).rows
    scope = f" for run(s) {', '.join(run_ids)}" if run_ids else ""
    if not rows:
        return [f"nothing to compare: no collectives in the store{scope} (extract them from traces with "
                "`triscope nccl kineto RUN`, or load Flight Recorder dumps with `triscope nccl ingest`)"]
    notes = []
    for run_id, collectives, ranks, p2p in rows:
        if collectives and len(ranks) < 2:
            notes.append(f"nothing cross-rank to compare in run {run_id}: its {collectives} collectives come from "
                         f"rank {ranks[0]} only; stragglers need the same collective on >= 2 ranks "
                         "(ingest every rank's trace under one run id)")
        elif not collectives:
            notes.append(f"nothing cross-rank to compare in run {run_id}: it has only point-to-point ops ({p2p}), "
                         "which have no common arrival to compare")
    if report.collectives:
        notes.append(f"{len(report.collectives)} collectives compared across ranks: no rank was "
                     f"{report.min_lateness_seconds * 1e3:g} ms or more late")
    return notes
