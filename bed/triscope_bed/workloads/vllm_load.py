"""Requests for the real vLLM engines: the three request classes, their token sizes, a measuring client.

A request is a ``/v1/completions`` call whose prompt is a list of token ids, with ``ignore_eos`` and
``min_tokens = max_tokens``, so prompt and completion lengths are exact and known before it is sent.
No vision or audio model runs here (every vision architecture needs torchvision, which the CPU
install lacks): an image or a video frame is **emulated as extra prompt tokens**, the count a
ViT-style encoder with 28-pixel patches (14-pixel patches merged 2x2) would hand the language
model. Prefill pays for those tokens; the encoder's own cost is not modelled. Sizes below and in
docs/vllm-testbed.md.

Each request carries its own W3C ``traceparent``; vLLM keeps it, so the stored span of a request is
found by its trace id. Names of the classes are the routing classes of docs/weights.md.
"""

from __future__ import annotations

import http.client
import json
import random
import secrets
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from triscope_bed.engines.vllm_classes import CLASSES, TOKEN_ID_RANGE, RequestClass
from triscope_bed.engines.vllm_cpu import SERVED_MODEL


@dataclass
class Sent:
    """What the client saw of one request."""

    request_class: str
    trace_id: str
    status: int
    elapsed_s: float
    """Client wall time from connect to the last byte of the answer."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    """From the answer's ``usage``."""
    started_unix: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def prompt_ids(cls: RequestClass, rng: random.Random) -> list[int]:
    """The text tokens then the emulated media tokens, drawn from :data:`TOKEN_ID_RANGE`."""
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(cls.prompt_tokens)]


def body(cls: RequestClass, rng: random.Random, model: str = SERVED_MODEL) -> dict[str, Any]:
    """The ``/v1/completions`` body: exact prompt length, exactly ``output_tokens`` generated."""
    return {"model": model, "prompt": prompt_ids(cls, rng), "max_tokens": cls.output_tokens,
            "min_tokens": cls.output_tokens, "ignore_eos": True, "temperature": 0.0}


def send(port: int, cls: RequestClass, rng: random.Random, host: str = "127.0.0.1", path: str = "/v1/completions",
         timeout_s: float = 120.0) -> Sent:
    """One request to ``host:port`` (a server or a load balancer in front of servers), timed by the client."""
    trace_id = secrets.token_hex(16)
    payload = json.dumps(body(cls, rng)).encode()
    headers = {"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    started_unix, t0 = time.time(), time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=payload, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        elapsed = time.monotonic() - t0
    except (OSError, http.client.HTTPException) as exc:
        return Sent(cls.name, trace_id, 0, time.monotonic() - t0, started_unix=started_unix, error=str(exc))
    finally:
        conn.close()
    sent = Sent(cls.name, trace_id, resp.status, elapsed, started_unix=started_unix)
    try:
        usage = json.loads(raw).get("usage") or {}
        sent.prompt_tokens, sent.completion_tokens = int(usage["prompt_tokens"]), int(usage["completion_tokens"])
    except (ValueError, KeyError, TypeError, AttributeError):
        sent.error = f"HTTP {resp.status}: {raw[:200]!r}"
    return sent


@dataclass
class Burst:
    """A list of request classes sent at once, ``concurrency`` at a time."""

    classes: Sequence[str]
    concurrency: int = 8
    seed: int = 0
    results: list[Sent] = field(default_factory=list)

    def run(self, port: int, host: str = "127.0.0.1", timeout_s: float = 120.0) -> list[Sent]:
        rngs = [random.Random(self.seed * 1_000_003 + i) for i in range(len(self.classes))]
        with ThreadPoolExecutor(max_workers=max(1, self.concurrency)) as pool:
            futures = [pool.submit(send, port, CLASSES[c], rng, host, timeout_s=timeout_s)
                       for c, rng in zip(self.classes, rngs, strict=True)]
            self.results = [f.result() for f in futures]
        return self.results


def mix(counts: dict[str, int], seed: int = 0) -> list[str]:
    """``{class: n}`` as one shuffled list of class names (reproducible for a seed)."""
    names = [name for name, n in counts.items() for _ in range(n)]
    unknown = set(names) - set(CLASSES)
    if unknown:
        raise ValueError(f"unknown request classes: {', '.join(sorted(unknown))} (known: {', '.join(CLASSES)})")
    random.Random(seed).shuffle(names)
    return names


def summary(results: Iterable[Sent]) -> dict[str, Any]:
    """Count, errors, and client latency min / median / max per class."""
    by: dict[str, list[Sent]] = {}
    for r in results:
        by.setdefault(r.request_class, []).append(r)
    out: dict[str, Any] = {}
    for name, rs in sorted(by.items()):
        times = sorted(r.elapsed_s for r in rs if r.ok)
        out[name] = {"sent": len(rs), "errors": sum(not r.ok for r in rs),
                     "latency_s": [round(times[0], 3), round(times[len(times) // 2], 3), round(times[-1], 3)]
                     if times else []}
    return out
