"""One job per run: files of one run (a directory, or ``--run-id``) whose world size or recorded time
disagree with the others' are another job, and are refused (docs/trace-breakdown.md)."""

from __future__ import annotations

from triscope.collectors.kineto.runs import IngestResult


def _compatible(result: IngestResult, group: list[IngestResult], within_ns: int) -> bool:
    sizes = {r.world_size for r in group if r.world_size is not None}
    if result.world_size is not None and sizes and result.world_size not in sizes:
        return False
    timed = [r for r in group if r.start_ns is not None and r.end_ns is not None]
    if result.start_ns is None or result.end_ns is None or not timed:
        return True
    lo = min(r.start_ns for r in timed if r.start_ns is not None)
    hi = max(r.end_ns for r in timed if r.end_ns is not None)
    return result.start_ns <= hi + within_ns and result.end_ns >= lo - within_ns


def _why(result: IngestResult, main: list[IngestResult]) -> str:
    sizes = sorted({r.world_size for r in main if r.world_size is not None})
    if result.world_size is not None and sizes and result.world_size not in sizes:
        return f"world size {result.world_size}, the others {'/'.join(map(str, sizes))}"
    starts = [r.start_ns for r in main if r.start_ns is not None]
    if result.start_ns is not None and starts:
        apart = (result.start_ns - min(starts)) / 1e9
        when = "after" if apart > 0 else "before"
        days = abs(apart) / 86400
        span = f"{days:.1f} days" if days >= 1 else f"{abs(apart) / 3600:.1f} hours"
        return f"recorded {span} {when} the others"
    return "a different job"


def other_jobs(results: list[IngestResult], within_s: float) -> list[tuple[IngestResult, str]]:
    """The files of one run that belong to another job than most of them, each with why.

    Files are grouped in batch order: a file joins the first group whose known world sizes match
    its own and whose recorded time span, widened by ``within_s`` on both sides, overlaps its own
    (a file without a world size or an absolute clock matches on what it has). The largest group
    (the first of equals) is the job; the others are refused.
    """
    within_ns = int(within_s * 1e9)
    groups: list[list[IngestResult]] = []
    for result in results:
        for group in groups:
            if _compatible(result, group, within_ns):
                group.append(result)
                break
        else:
            groups.append([result])
    if len(groups) < 2:
        return []
    main = max(groups, key=len)
    return [(r, _why(r, main)) for group in groups if group is not main for r in group]
