"""Open-loop, bursty multimodal load generator for the closed-loop bench.

The arrival schedule is computed up front from a seed, so every policy sees exactly the same
offered load: per-class Poisson arrivals whose rate steps up by ``step_factor`` (+30%) every
``step_s`` seconds and is modulated by bursts (``burst_factor`` x for ``burst_s`` every
``burst_period_s``, phase-shifted per class, mean-preserving). Requests are sent on time
whatever the responses do (no coordinated omission) over a pool of keep-alive connections.

Two request shapes: ``GET /v1/infer/<class>`` (the simulator's class costs; the default) and, with
``drive(..., api="completions")``, ``POST /v1/completions`` with a synthetic prompt of about
``prompt_tokens x 4`` characters, for peers that route on the request text (sglang-router, the
Gateway API inference extension's picker). Named workloads (real trace replay, flash crowd, ...)
are built by :mod:`triscope.sim.workloads`; docs/workloads.md describes both.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import math
import multiprocessing
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from triscope.sim.engine import CLASSES, MODEL, RequestClass

MAX_PROMPT_CHARS = 48_000
"""Cap of the synthetic prompt text: the simulated backend refuses bodies over 64 KiB."""
MAX_TOKENS = 1_000_000
"""Bound of ``prompt_tokens`` / ``max_tokens`` in a request (what the simulated backend accepts)."""
MAX_ERROR_CHARS = 200
"""How much of an error answer's reason a :class:`Result` keeps."""


@dataclass(frozen=True)
class Arrival:
    t: float
    cls: str
    step: int
    """Index of the load step, or of the ``bucket_s``-long time bucket of a replay (see workloads)."""
    prompt_tokens: int | None = None
    """Prompt length (None: the class's default, :data:`~triscope.sim.engine.CLASSES`)."""
    max_tokens: int | None = None
    """Tokens to generate (None: the class's default)."""

    def tokens(self) -> tuple[int, int]:
        """(prompt, max) tokens of the request, the class's defaults filling what the arrival lacks."""
        cls = CLASSES[self.cls]
        prompt = self.prompt_tokens if self.prompt_tokens is not None else cls.prompt_tokens
        out = self.max_tokens if self.max_tokens is not None else cls.completion_tokens
        return max(1, min(MAX_TOKENS, prompt)), max(1, min(MAX_TOKENS, out))


@dataclass
class LoadShape:
    """The offered load: QPS steps, class mix and bursts."""

    base_qps: float = 20.0
    step_factor: float = 1.3
    steps: int = 6
    step_s: float = 8.0
    burst_period_s: float = 4.0
    burst_s: float = 1.0
    burst_factor: float = 3.0
    mix: dict[str, float] = field(default_factory=lambda: {c.name: c.share for c in CLASSES.values()})

    def step_qps(self, step: int) -> float:
        return self.base_qps * self.step_factor**step

    @property
    def duration_s(self) -> float:
        return self.steps * self.step_s

    def _modulation(self, t: float, phase: float) -> float:
        """Mean-1 burst multiplier: ``burst_factor`` inside a burst, a lower floor outside."""
        duty = self.burst_s / self.burst_period_s
        if duty >= 1.0 or self.burst_factor <= 1.0:
            return 1.0
        low = max(0.0, (1.0 - duty * self.burst_factor) / (1.0 - duty))
        inside = ((t + phase) % self.burst_period_s) < self.burst_s
        return self.burst_factor if inside else low

    def schedule(self, seed: int = 1) -> list[Arrival]:
        """All arrivals, sorted by time (thinning of a non-homogeneous Poisson process)."""
        rng = random.Random(seed)
        out: list[Arrival] = []
        total_share = sum(self.mix.values())
        for k, (name, share) in enumerate(sorted(self.mix.items())):
            phase = k * self.burst_period_s / max(1, len(self.mix))
            for step in range(self.steps):
                lam = self.step_qps(step) * share / total_share
                lam_max = lam * max(1.0, self.burst_factor)
                t = step * self.step_s
                end = t + self.step_s
                while True:
                    t += rng.expovariate(lam_max) if lam_max > 0 else math.inf
                    if t >= end:
                        break
                    if rng.random() * lam_max <= lam * self._modulation(t, phase):
                        out.append(Arrival(t, name, step))
        out.sort(key=lambda a: a.t)
        return out


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


MAX_RESPONSE_BYTES = 1 << 20


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer


class HttpPool:
    """Minimal HTTP/1.1 keep-alive client (GET and JSON POST), enough for the bench's tiny responses."""

    def __init__(self, host: str, port: int, max_idle: int = 512) -> None:
        self.host = host
        self.port = port
        self.idle: list[_Conn] = []
        self.max_idle = max_idle

    async def _connect(self) -> _Conn:
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        return _Conn(reader, writer)

    async def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        """One GET; retries once on a stale pooled connection."""
        return await self.request("GET", path)

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
        """One request (a JSON body when given); retries once on a stale pooled connection."""
        for attempt in range(2):
            conn = self.idle.pop() if self.idle else await self._connect()
            try:
                return await self._exchange(conn, method, path, body)
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                with contextlib.suppress(Exception):
                    conn.writer.close()
                if attempt:
                    raise
            except asyncio.CancelledError:  # client timeout: hang up, as a real client would
                with contextlib.suppress(Exception):
                    conn.writer.close()
                raise
        raise ConnectionError("unreachable")

    async def _exchange(self, conn: _Conn, method: str, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        request = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n"
        if body or method == "POST":
            request += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        conn.writer.write((request + "\r\n").encode() + body)
        await conn.writer.drain()
        head = await conn.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        length = int(headers.get("content-length", "0") or 0)
        if not 0 <= length <= MAX_RESPONSE_BYTES:  # a peer's answer is small; never buffer an unbounded one
            raise ValueError(f"response of {length} bytes")
        body = await conn.reader.readexactly(length)
        if headers.get("connection", "").lower() == "close" or len(self.idle) >= self.max_idle:
            conn.writer.close()
        else:
            self.idle.append(conn)
        return status, headers, body

    def close(self) -> None:
        for conn in self.idle:
            with contextlib.suppress(Exception):
                conn.writer.close()
        self.idle.clear()


_WORDS = ("the", "a", "of", "and", "to", "in", "is", "for", "on", "with", "data", "model", "code", "value",
          "return", "list", "time", "user", "file", "error", "test", "input", "output", "index", "result",
          "string", "number", "class", "function", "request", "server", "memory", "batch", "token", "query")


CHARS_PER_TOKEN = 4.0
"""Characters of synthetic prompt per requested prompt token (the tiny vLLM model's tokenizer reads
about 4.8 of these characters per token, so a real engine sees about 0.83 x ``prompt_tokens``)."""
MAX_SALT_CHARS = 64


def synthetic_prompt(idx: int, cls: str, prompt_tokens: int, salt: str = "",
                     chars_per_token: float = CHARS_PER_TOKEN) -> str:
    """Deterministic text of about ``prompt_tokens x chars_per_token`` characters (at most :data:`MAX_PROMPT_CHARS`).

    It opens with ``salt`` and the arrival's index, so no two requests share a prefix (the replayed
    trace has no text, hence no prefix sharing to model); a salt per run (say policy and seed) also
    keeps an engine's prefix cache from serving a later run the prompts of an earlier one. The rest
    is a slice, placed by ``idx``, of a fixed run of common English words (a slice, not a loop per
    request, so a 30 kB prompt costs microseconds).
    """
    if not 0.5 <= chars_per_token <= 64 or len(salt) > MAX_SALT_CHARS:
        raise ValueError(f"chars_per_token in [0.5, 64] and a salt of <= {MAX_SALT_CHARS} characters expected")
    want = min(MAX_PROMPT_CHARS, max(8, round(prompt_tokens * chars_per_token)))
    head = f"{salt} request {idx} {cls}: " if salt else f"request {idx} {cls}: "
    words = _word_pool()
    start = (idx * 7919) % (len(words) - MAX_PROMPT_CHARS)
    return (head + words[start:start + want])[:want]


_POOL: list[str] = []


def _word_pool() -> str:
    """2 x :data:`MAX_PROMPT_CHARS` of words in a fixed pseudo-random order (an LCG: the same in every process)."""
    if not _POOL:
        parts, n, x = [], 0, 12345
        while n < 2 * MAX_PROMPT_CHARS:
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
            word = _WORDS[(x >> 16) % len(_WORDS)]
            parts.append(word)
            n += len(word) + 1
        _POOL.append(" ".join(parts))
    return _POOL[0]


MAX_EXTRA_BODY_BYTES = 4096


def completion_body(a: Arrival, idx: int, model: str = MODEL, *, salt: str = "",
                    chars_per_token: float = CHARS_PER_TOKEN, extra: dict[str, Any] | None = None) -> bytes:
    """The ``POST /v1/completions`` JSON of one arrival (OpenAI fields plus the simulator's token counts).

    ``extra``: more fields for a real engine (``{"ignore_eos": True, "min_tokens": ...}`` makes vLLM
    generate exactly ``max_tokens``); it may not replace the fields above and is at most 4 KiB.
    """
    prompt, out = a.tokens()
    doc: dict[str, Any] = {"model": model, "prompt": synthetic_prompt(idx, a.cls, prompt, salt, chars_per_token),
                           "prompt_tokens": prompt, "max_tokens": out, "request_class": a.cls}
    if extra:
        clash = doc.keys() & extra.keys()
        if clash or len(json.dumps(extra)) > MAX_EXTRA_BODY_BYTES:
            raise ValueError(f"extra body fields: {', '.join(sorted(clash)) or 'over 4 KiB'}")
        doc.update(extra)
    return json.dumps(doc).encode()


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


def _ready() -> bool:
    return True


def _drive_here(host: str, port: int, schedule: list[Arrival], kwargs: dict[str, Any]) -> tuple[list[Result], float]:
    return asyncio.run(drive(host, port, schedule, **kwargs))


class ClientProcess:
    """Runs :func:`drive` in a process of its own, as a real client is: a picker serving in the caller's
    process then shares no interpreter lock with the client's event loop. Spawned (the caller may run
    gRPC threads, which do not survive a fork) and started on entry, so a schedule sent later starts
    at once (a scenario's timer in the caller stays in step with it)."""

    def __enter__(self) -> ClientProcess:
        ctx = multiprocessing.get_context("spawn")
        self._pool = concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx)
        self._pool.submit(_ready).result()  # imports this module there before any schedule
        return self

    def drive(self, host: str, port: int, schedule: list[Arrival], **kwargs: Any) -> tuple[list[Result], float]:
        """:func:`drive` with these arguments in the client process; blocks until the schedule is done."""
        return self._pool.submit(_drive_here, host, port, schedule, kwargs).result()

    def pids(self) -> set[int]:
        """The client's process ids."""
        return set(getattr(self._pool, "_processes", None) or {})

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(cancel_futures=True)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (NaN for no values)."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100.0 * len(s)) - 1))
    return s[k]
