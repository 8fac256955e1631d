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

from triscope.sim.vllm_cpu import SERVED_MODEL

TOKEN_ID_RANGE = (16, 4000)
"""Prompt token ids are drawn from here: clear of the tiny tokenizer's special tokens (0-5), inside its 4096."""


@dataclass(frozen=True)
class RequestClass:
    """Token sizes of one kind of request (prompt = text + media tokens)."""

    name: str
    kind: str
    text_tokens: int
    media_tokens: int
    output_tokens: int
    media: str = ""

    @property
    def prompt_tokens(self) -> int:
        return self.text_tokens + self.media_tokens


CLASSES: dict[str, RequestClass] = {c.name: c for c in (
    # a spoken turn: its transcript with some context in, a short spoken answer out
    RequestClass("realtime_speech", "speech", text_tokens=48, media_tokens=0, output_tokens=16),
    # a question about one 336x336 image: 12 x 12 patches of 28 px = 144 image tokens
    RequestClass("interactive_image_text", "image-text", text_tokens=32, media_tokens=144, output_tokens=96,
                 media="1 image 336x336 = 144 tokens"),
    # a summary of a clip: 4 frames of 224x224, 8 x 8 patches each = 256 tokens
    RequestClass("offline_video", "video", text_tokens=16, media_tokens=256, output_tokens=128,
                 media="4 frames 224x224 = 4 x 64 tokens"),
)}
"""Every class fits ``--max-model-len 512`` (the largest, video, is 272 + 128 = 400 tokens). Image-text and
video cross a 128-token KV block boundary while decoding (176 -> 272, 272 -> 400), so a full cache preempts."""


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
