"""Simulated vLLM-style backends over HTTP/1.1 (asyncio), one :class:`~triscope_bed.engines.engine.Engine` each.

Routes: ``POST /v1/completions`` (``{"prompt_tokens": N, "max_tokens": M, "request_class": ...}``,
costs from tokens; the demo), ``GET /v1/infer/<class>`` (costs from the class; the bench),
``GET /metrics``, ``GET /health``; bench controls ``POST /sim/pressure?bytes=N`` (pin KV),
``POST /sim/reset`` (clear counters and pressure), ``GET /sim/state`` (JSON). For sglang-router
(docs/peers.md): ``GET /server_info``, ``/model_info`` (and their ``/get_*`` aliases) and ``GET /get_load``
(SGLang's load report, from the engine state); ``GET /sim/calls`` counts how often each was asked.

``python -m triscope_bed.engines.backend --backend b0:18001:40:16:1.0 --backend b1:18002:20:16:0.5``
(``name:port:kv_gib:slots:speed``) serves several backends in one process and prints one JSON
line when all ports listen; :class:`BackgroundBackends` runs them on a thread of the caller.
``--profile vllm-cpu`` gives every backend a calibrated engine (:mod:`triscope_bed.engines.calibration`:
per-token costs, batch slowdown, paged KV with preemption; docs/calibration.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from triscope_bed.engines.calibration import PROFILES, SimProfile
from triscope_bed.engines.engine import CLASSES, GIB, Engine, EngineSpec, Served
from triscope_bed.engines.prefix_cache import MAX_PREFIX_BLOCKS

MAX_HEADER_BYTES = 16 * 1024
MAX_BODY_BYTES = 64 * 1024
JSON = "application/json"
# Worker endpoints sglang-router polls (docs/peers.md); counted so tests can see the router really asks.
ROUTER_GETS = ("/health", "/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load")


@dataclass
class BackendSpec:
    """A bench backend as given on the command line (``name:port[:kv_gib[:slots[:speed]]]``)."""

    name: str
    port: int
    kv_gib: float = 40.0
    slots: int = 16
    speed: float = 1.0
    batch_slowdown: float = 0.8
    staged_fraction: float = 0.25
    host: str = "127.0.0.1"
    profile: SimProfile | None = None
    """Engine costs and KV model from a calibration profile (its slowdown and staging replace the two above)."""

    @classmethod
    def parse(cls, text: str) -> BackendSpec:
        parts = text.split(":")
        if len(parts) < 2:
            raise ValueError(f"backend spec {text!r}: expected name:port[:kv_gib[:slots[:speed]]]")
        spec = cls(parts[0], int(parts[1]))
        if len(parts) > 2:
            spec.kv_gib = float(parts[2])
        if len(parts) > 3:
            spec.slots = int(parts[3])
        if len(parts) > 4:
            spec.speed = float(parts[4])
        return spec

    def to_arg(self) -> str:
        return f"{self.name}:{self.port}:{self.kv_gib}:{self.slots}:{self.speed}"

    def engine(self) -> EngineSpec:
        if self.profile is not None:
            return self.profile.engine_spec(self.name, self.kv_gib, self.slots, self.speed)
        return EngineSpec(self.name, int(self.kv_gib * GIB), slots=self.slots, speed=self.speed,
                          batch_slowdown=self.batch_slowdown, staged_fraction=self.staged_fraction)


class SimBackend:
    """One simulated engine behind its own HTTP port."""

    def __init__(self, spec: EngineSpec, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine = Engine(spec)
        self.spec = spec
        self.host = host
        self._port = port
        self.server: asyncio.AbstractServer | None = None
        self.calls = dict.fromkeys(ROUTER_GETS, 0)

    @property
    def port(self) -> int:
        """The bound port (the one asked for before :meth:`start`)."""
        return self._port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve_conn, self.host, self._port,
                                                 limit=MAX_HEADER_BYTES, backlog=1024)
        self._port = int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()

    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                try:
                    method, target, _version = lines[0].split(" ", 2)
                except ValueError:
                    await _respond(writer, 400, {"error": "bad request line"}, close=True)
                    return
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                try:
                    length = int(headers.get("content-length", "0") or 0)
                except ValueError:
                    length = -1
                if not 0 <= length <= MAX_BODY_BYTES:
                    await _respond(writer, 413 if length > 0 else 400, {"error": "bad or too large body"}, close=True)
                    return
                body = await reader.readexactly(length) if length else b""
                close = headers.get("connection", "").lower() == "close"
                status, doc, ctype = await self._route(method, target, body)
                await _respond(writer, status, doc, close=close, ctype=ctype, extra={"X-Backend": self.spec.name})
                if close:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _route(self, method: str, target: str, body: bytes) -> tuple[int, object, str]:
        url = urlsplit(target)
        path, engine = url.path, self.engine
        if path.startswith("/v1/infer/"):
            cls = CLASSES.get(path.rsplit("/", 1)[-1])
            if cls is None:
                return 404, {"error": "unknown request class"}, JSON
            # a paged engine sizes KV from tokens: the class's own counts
            tokens = (cls.prompt_tokens, cls.completion_tokens) if engine.paged is not None else (0, 0)
            done = await engine.serve(cls.name, cls.kv_bytes, (0.3 * cls.service_s, 0.7 * cls.service_s), tokens)
            if isinstance(done, str):
                return 503, {"error": done, "backend": self.spec.name}, JSON
            return 200, {"backend": self.spec.name, "class": cls.name, "queue_s": round(done.queue_s, 6),
                         "latency_s": round(done.e2e_s, 6)}, JSON
        if path == "/v1/completions" and method == "POST":
            status, doc = await self._completion(body)
            return status, doc, JSON
        if path == "/metrics":
            return 200, engine.metrics_text(), "text/plain; version=0.0.4; charset=utf-8"
        if path in self.calls and method == "GET":
            self.calls[path] += 1
        if path in ("/health", "/healthz"):
            return 200, {"status": "ok"}, JSON
        if path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load") \
                and method == "GET":
            return 200, self._sglang_info(path), JSON
        if path == "/sim/calls":
            return 200, dict(self.calls), JSON
        if path == "/sim/state":
            return 200, engine.state_json(), JSON
        if path == "/sim/reset" and method == "POST":
            engine.reset()
            return 200, engine.state_json(), JSON
        if path == "/sim/pressure" and method == "POST":
            try:
                value = int(parse_qs(url.query).get("bytes", ["0"])[0])
            except ValueError:
                return 400, {"error": "bytes must be an integer"}, JSON
            engine.set_pressure(value)
            return 200, engine.state_json(), JSON
        return 404, {"error": f"no route {path}"}, JSON

    def _sglang_info(self, path: str) -> object:
        """SGLang's worker info and load documents, truthful for this simulated engine."""
        s, engine = self.spec, self.engine
        if path == "/get_load":
            # SGLang's scheduler load report, one entry per data-parallel rank (this engine has one).
            return [{"dp_rank": 0, "num_reqs": engine.running + engine.waiting, "num_waiting_reqs": engine.waiting,
                     "num_tokens": engine.kv_tokens()}]
        model = {"model_path": s.model, "tokenizer_path": s.model, "is_generation": True}
        if path.endswith("model_info"):
            return model
        return {**model, "served_model_name": s.model, "version": "triscope-sim", "tp_size": 1, "dp_size": 1,
                "max_running_requests": s.slots,
                "max_total_num_tokens": int(s.kv_capacity_bytes // s.kv_bytes_per_token)}

    async def _completion(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """``POST /v1/completions``: KV and service time from the token counts."""
        try:
            doc = json.loads(body or b"{}")
            prompt, completion = int(doc["prompt_tokens"]), int(doc["max_tokens"])
            if not (0 < prompt <= 1_000_000 and 0 < completion <= 1_000_000):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            return 400, {"error": "body needs positive integer prompt_tokens and max_tokens"}
        blocks, per_block = doc.get("prefix_blocks", []), doc.get("block_tokens", 0)
        if (not isinstance(blocks, list) or len(blocks) > MAX_PREFIX_BLOCKS or not isinstance(per_block, int)
                or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks)
                or (blocks and not 0 < per_block <= 1_000_000)):
            return 400, {"error": f"prefix_blocks must be at most {MAX_PREFIX_BLOCKS} integers with a positive "
                                  "block_tokens"}
        s = self.spec
        cls = str(doc.get("request_class", ""))
        done = await self.engine.serve(cls if cls in CLASSES else "", (prompt + completion) * s.kv_bytes_per_token,
                                       (prompt * s.prefill_s_per_token, completion * s.decode_s_per_token),
                                       (prompt, completion), (tuple(blocks), per_block))
        if isinstance(done, str):
            return 503, {"error": done, "backend": s.name}
        return 200, {"backend": s.name, "model": s.model,
                     "usage": {"prompt_tokens": prompt, "completion_tokens": completion}, "timings": _timings(done)}


def _timings(done: Served) -> dict[str, float]:
    return {"queue_s": done.queue_s, "ttft_s": done.ttft_s, "e2e_s": done.e2e_s, "prefill_s": done.prefill_s,
            "decode_s": done.decode_s}


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 413: "Payload Too Large", 503: "Service Unavailable"}


async def _respond(writer: asyncio.StreamWriter, status: int, body: object, close: bool = False,
                   ctype: str = JSON, extra: dict[str, str] | None = None) -> None:
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}", f"Content-Type: {ctype}", f"Content-Length: {len(data)}"]
    for k, v in (extra or {}).items():
        head.append(f"{k}: {v}")
    if close:
        head.append("Connection: close")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    await writer.drain()


class BackgroundBackends:
    """Backends served by an asyncio loop on a daemon thread (the demo's in-process fleet)."""

    def __init__(self, backends: list[SimBackend]) -> None:
        self.backends = backends
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sim-backends", daemon=True)

    def start(self) -> BackgroundBackends:
        self._thread.start()
        for b in self.backends:
            asyncio.run_coroutine_threadsafe(b.start(), self._loop).result(timeout=10)
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._loop.is_running():
            self._loop.close()

    async def _shutdown(self) -> None:
        for b in self.backends:
            await b.close()
        # connections still open (a client that never hung up): end their handlers, not leave them pending
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def serve(specs: list[BackendSpec]) -> None:
    """Run all backends until SIGTERM/SIGINT."""
    backends = [SimBackend(s.engine(), s.host, s.port) for s in specs]
    for b in backends:
        await b.start()
    print(json.dumps({"ready": [s.to_arg() for s in specs]}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for b in backends:
        await b.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="simulated vLLM-style backends for the closed-loop bench")
    parser.add_argument("--backend", action="append", required=True,
                        help="name:port[:kv_gib[:slots[:speed]]] (repeat)")
    parser.add_argument("--batch-slowdown", type=float, default=None,
                        help="service-time growth at a full batch (1 + x * running/slots); default 0.8")
    parser.add_argument("--staged-fraction", type=float, default=None,
                        help="share of a request's KV held from arrival (staged inputs) before it runs; default 0.25")
    parser.add_argument("--profile", choices=sorted(PROFILES), default=None,
                        help="calibrated engine model (docs/calibration.md); excludes the two options above")
    args = parser.parse_args(argv)
    if args.profile is not None and (args.batch_slowdown is not None or args.staged_fraction is not None):
        print("error: --profile sets the batch slowdown and staging; drop --batch-slowdown / --staged-fraction",
              file=sys.stderr)
        return 2
    try:
        specs = [BackendSpec.parse(s) for s in args.backend]
        for s in specs:
            s.profile = PROFILES[args.profile] if args.profile is not None else None
            if s.profile is not None:
                Engine(s.engine())  # a pool the profile cannot use (no whole block) fails here, in one line
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for s in specs:
        s.batch_slowdown = 0.8 if args.batch_slowdown is None else args.batch_slowdown
        s.staged_fraction = 0.25 if args.staged_fraction is None else args.staged_fraction
    asyncio.run(serve(specs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
