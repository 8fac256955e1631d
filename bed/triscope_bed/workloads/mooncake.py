"""The Mooncake conversation trace replayed with its prefix sharing kept.

One hour of Moonshot AI's Kimi conversation service, 12,031 requests: arrival time (ms), input and output
lengths, and one id per 512-token block of each prompt (equal ids are equal blocks, so a system prompt or
a conversation's history recurs as the same ids). From kvcache-ai/Mooncake
``FAST25-release/traces/conversation_trace.jsonl`` (Apache-2.0), published with Qin et al., "Mooncake:
Trading More Storage for Less Computation", FAST 2025.

The trace has no text. :func:`block_text` makes each block id the same deterministic text wherever it
appears, so two requests whose ids agree up to block k have prompts that agree up to block k, on every
engine and every router. ``token_scale`` shrinks every block alike (the real bed's context is 512
tokens, the trace's prompts thousands), which keeps the sharing structure; the simulator takes it full size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triscope_bed.paths import REPO
from triscope_bed.workloads.arrivals import Arrival
from triscope_bed.workloads.common import BUCKET_S, MAX_ROWS, WorkloadError, assign_class

DEFAULT_TRACE = REPO.parent / "shared" / "data" / "workloads" / "mooncake_conversation_trace.jsonl"
"""``<repo>/../shared/data/workloads/mooncake_conversation_trace.jsonl`` (not in the repository)."""
BLOCK_TOKENS = 512
"""Tokens per block id in the trace."""
MAX_LINE_BYTES = 1 << 20


@dataclass(frozen=True)
class MooncakeRow:
    """One request of the trace: seconds since its first request, lengths, and its prompt's block ids."""

    t: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _row(doc: Any, where: str) -> tuple[float, int, int, tuple[int, ...]]:
    if not isinstance(doc, dict):
        raise WorkloadError(f"{where}: not a JSON object")
    ts, inp, out, ids = (doc.get(k) for k in ("timestamp", "input_length", "output_length", "hash_ids"))
    ints = (ts, inp, out)
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in ints) or not inp or not out:
        raise WorkloadError(f"{where}: timestamp, input_length and output_length must be integers "
                            "(lengths > 0)")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise WorkloadError(f"{where}: hash_ids must be a list of non-negative integers")
    assert isinstance(ts, int) and isinstance(inp, int) and isinstance(out, int)  # checked above
    if len(ids) != math.ceil(inp / BLOCK_TOKENS):
        raise WorkloadError(f"{where}: {len(ids)} hash_ids for {inp} input tokens "
                            f"({math.ceil(inp / BLOCK_TOKENS)} blocks of {BLOCK_TOKENS} expected)")
    return ts / 1000.0, inp, out, tuple(ids)


def load_mooncake(path: str | Path | None = None, max_rows: int = MAX_ROWS) -> list[MooncakeRow]:
    """The trace's rows in file order, times relative to the first row (WorkloadError, one line, on bad input)."""
    p = Path(path) if path is not None else DEFAULT_TRACE
    if not p.is_file():
        raise WorkloadError(f"trace file not found: {p} (the Mooncake conversation trace; pass its path)")
    rows: list[MooncakeRow] = []
    t0: float | None = None
    with p.open("rb") as fh:
        for n, line in enumerate(fh, 1):
            if len(rows) >= max_rows:
                break
            if len(line) > MAX_LINE_BYTES:
                raise WorkloadError(f"{p}: line {n} is over {MAX_LINE_BYTES} bytes")
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except ValueError as exc:
                raise WorkloadError(f"{p}: line {n}: not JSON ({exc})") from None
            t, inp, out, ids = _row(doc, f"{p}: line {n}")
            t0 = t if t0 is None else t0
            rows.append(MooncakeRow(t - t0, inp, out, ids))
    if not rows:
        raise WorkloadError(f"{p}: no rows")
    return rows


def scaled(row: MooncakeRow, token_scale: float, max_total_tokens: int | None) -> tuple[int, int, tuple[int, ...], int]:
    """(prompt tokens, output tokens, block ids, tokens per block) of ``row`` at ``token_scale``.

    Every block shrinks alike (at least one token), the last one keeps its share of a partial block; under
    ``max_total_tokens`` whole trailing blocks are cut, so what remains is still the request's prefix.
    """
    per_block = max(1, round(BLOCK_TOKENS * token_scale))
    tail = row.input_length - BLOCK_TOKENS * (len(row.hash_ids) - 1)
    prompt = per_block * (len(row.hash_ids) - 1) + max(1, round(tail * token_scale))
    out = max(1, round(row.output_length * token_scale))
    ids = row.hash_ids
    if max_total_tokens is not None:
        out = min(out, max(1, max_total_tokens // 2))
        room = max(1, max_total_tokens - out)
        if prompt > room:
            keep = max(1, room // per_block)
            ids, prompt = ids[:keep], min(room, per_block * keep)
    return prompt, out, ids, per_block


def mooncake(seed: int, backends: int, *, qps_per_backend: float | None = None, duration_s: float = 300.0,
             start_s: float = 0.0, token_scale: float = 1.0, max_total_tokens: int | None = None,
             trace: str | Path | None = None, bucket_s: float = BUCKET_S,
             mix: dict[str, float] | None = None) -> list[Arrival]:
    """``mooncake``: the trace's window from ``start_s``, at its own rate (``qps_per_backend`` None) or compressed
    so that ``qps_per_backend x backends`` requests a second fill ``duration_s``; classes drawn per row as for
    ``azure``; every arrival carries its block ids."""
    if token_scale <= 0 or bucket_s <= 0 or duration_s <= 0:
        raise WorkloadError("token_scale, bucket_s and duration_s must be > 0")
    rows = load_mooncake(trace)
    first = next((i for i, r in enumerate(rows) if r.t >= start_s), len(rows))
    if first >= len(rows):
        raise WorkloadError(f"start_s {start_s} is past the trace's end ({rows[-1].t:.0f} s)")
    if qps_per_backend is None:
        window = [r for r in rows[first:] if r.t < start_s + duration_s]
        compress, t0 = 1.0, start_s
    else:
        if qps_per_backend <= 0:
            raise WorkloadError("qps_per_backend must be > 0 (or None for the trace's own rate)")
        want = max(1, round(qps_per_backend * backends * duration_s))
        if first + want > len(rows):
            raise WorkloadError(f"the trace has {len(rows) - first} requests after {start_s} s, {want} needed "
                                f"for {qps_per_backend * backends:g} QPS x {duration_s:g} s")
        window = rows[first:first + want]
        span = window[-1].t - window[0].t
        compress = (span * want / (want - 1) / duration_s) if want > 1 and span > 0 else 1.0
        t0 = window[0].t
    out = []
    for k, r in enumerate(window):
        t = (r.t - t0) / compress
        prompt, gen, ids, per_block = scaled(r, token_scale, max_total_tokens)
        out.append(Arrival(t, assign_class(seed, first + k, mix), int(t // bucket_s), prompt, gen,
                           blocks=ids, block_tokens=per_block))
    return out


def recurring_share(arrivals: list[Arrival]) -> float:
    """Share of the arrivals' blocks whose id was seen in an earlier arrival (what a perfect cache could hit)."""
    seen: set[int] = set()
    hits = total = 0
    for a in arrivals:
        for b in a.blocks:
            hits += b in seen
            total += 1
        seen.update(a.blocks)
    return hits / total if total else 0.0


__all__ = ["BLOCK_TOKENS", "DEFAULT_TRACE", "MooncakeRow", "load_mooncake", "mooncake", "recurring_share", "scaled"]
