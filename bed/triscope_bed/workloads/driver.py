"""Send a schedule open-loop and record what each request got.

Requests are sent on time whatever the responses do (no coordinated omission) over a pool of
keep-alive connections. Two request shapes: ``GET /v1/infer/<class>`` (the simulator's class costs;
the default) and, with ``drive(..., api="completions")``, ``POST /v1/completions`` with a synthetic
prompt (:mod:`triscope_bed.workloads.prompts`), for peers that route on the request text
(sglang-router, the Gateway API inference extension's picker).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from triscope_bed.engines.engine import CLASSES, MODEL, RequestClass
from triscope_bed.workloads.arrivals import Arrival
from triscope_bed.workloads.http_pool import HttpPool
from triscope_bed.workloads.prompts import CHARS_PER_TOKEN, completion_body

MAX_ERROR_CHARS = 200
"""How much of an error answer's reason a :class:`Result` keeps."""


@dataclass
class Result:
    t: float
    cls: str
    step: int
    status: int
    latency_s: float
    backend: str
    idx: int = -1
    """Position of the arrival in the schedule (the same request across policies)."""
    engine_queue_s: float = math.nan
    """Time the request waited inside the engine for a batch slot and its KV (NaN: no answer)."""
    reason: str = ""
    """The ``error`` field of a non-200 JSON answer, else its first bytes (empty on success)."""
    prompt_tokens: int = -1
    """``usage.prompt_tokens`` of a 200 answer (-1: the answer had none, e.g. ``GET /v1/infer``)."""
    completion_tokens: int = -1
    """``usage.completion_tokens`` of a 200 answer (-1: none)."""


async def _one(pool: HttpPool, a: Arrival, t_start: float, timeout_s: float, out: list[Result],
               idx: int = -1, body: bytes | None = None) -> None:
    sent = time.monotonic()
    queue_s, reason, usage = math.nan, "", (-1, -1)
    try:
        call = pool.get(f"/v1/infer/{a.cls}") if body is None else pool.request("POST", "/v1/completions", body)
        status, headers, answer = await asyncio.wait_for(call, timeout_s)
        backend = headers.get("x-backend", "")
        if status == 200:
            queue_s, usage = _answer_fields(answer)
        else:
            reason = _reason(answer)
    except TimeoutError:
        status, backend = 0, ""
    except (ConnectionError, OSError, asyncio.IncompleteReadError, ValueError):
        status, backend = -1, ""
    out.append(Result(sent - t_start, a.cls, a.step, status, time.monotonic() - sent, backend, idx, queue_s,
                      reason, *usage))


def _answer_fields(body: bytes) -> tuple[float, tuple[int, int]]:
    """``queue_s`` (a simulated backend's; NaN when absent) and the echoed ``usage`` ((-1, -1) when absent)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return math.nan, (-1, -1)
    if not isinstance(doc, dict):
        return math.nan, (-1, -1)
    try:
        queue_s = float(doc.get("queue_s", (doc.get("timings") or {}).get("queue_s", math.nan)))
    except (ValueError, TypeError, AttributeError):
        queue_s = math.nan
    usage = doc.get("usage")
    try:
        pair = (int(usage["prompt_tokens"]), int(usage["completion_tokens"])) if isinstance(usage, dict) else (-1, -1)
    except (KeyError, ValueError, TypeError):
        pair = (-1, -1)
    return queue_s, pair


def _reason(body: bytes) -> str:
    """Why a request failed, from its answer: the JSON ``error`` field (or its ``message``), else the text."""
    try:
        err = json.loads(body).get("error", "")
    except (ValueError, TypeError, AttributeError):
        return body[:MAX_ERROR_CHARS].decode("utf-8", errors="replace")
    return str(err.get("message", err) if isinstance(err, dict) else err)[:MAX_ERROR_CHARS]


async def drive(host: str, port: int, schedule: list[Arrival], timeout_factor: float = 6.0,
                progress: Callable[[float], None] | None = None, api: str = "infer",
                model: str = MODEL, prompt_salt: str = "", chars_per_token: float = CHARS_PER_TOKEN,
                extra_body: dict[str, Any] | None = None,
                slas: dict[str, float] | None = None) -> tuple[list[Result], float]:
    """Send ``schedule`` open-loop; returns results and the worst send lag (s) behind schedule.

    ``api="infer"`` sends ``GET /v1/infer/<class>``; ``api="completions"`` sends ``POST /v1/completions``
    (:func:`completion_body` with ``prompt_salt``, ``chars_per_token`` and ``extra_body``, each body
    built just before its send time so memory stays bounded). A request times out after
    ``max(2 s, timeout_factor x its class SLA)``, the SLA from ``slas`` when given (a CPU test bed's).
    """
    if api not in ("infer", "completions"):
        raise ValueError(f"api {api!r}: expected 'infer' or 'completions'")
    if api == "completions" and schedule:  # a bad salt / extra fails here, before anything is sent
        completion_body(schedule[0], 0, model, salt=prompt_salt, chars_per_token=chars_per_token, extra=extra_body)
    pool = HttpPool(host, port)
    results: list[Result] = []
    tasks: set[asyncio.Task[None]] = set()
    t_start = time.monotonic()
    worst_lag = 0.0
    for i, a in enumerate(schedule):
        delay = a.t - (time.monotonic() - t_start)
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            worst_lag = max(worst_lag, -delay)
        cls: RequestClass = CLASSES[a.cls]
        body = (completion_body(a, i, model, salt=prompt_salt, chars_per_token=chars_per_token, extra=extra_body)
                if api == "completions" else None)
        sla = (slas or {}).get(a.cls, cls.sla_s)
        task = asyncio.create_task(_one(pool, a, t_start, max(2.0, sla * timeout_factor), results, i, body))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if progress is not None and i % 50 == 0:
            progress(a.t)
    if tasks:
        await asyncio.gather(*list(tasks))
    pool.close()
    return results, worst_lag
