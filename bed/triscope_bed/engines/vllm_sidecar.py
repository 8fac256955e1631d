"""The SGLang worker endpoints in front of a real vLLM server, for sglang-router (docs/peers.md).

sglang-router registers a worker with ``GET /server_info`` / ``/model_info`` and, under
``power_of_two``, asks it ``GET /get_load`` every 30 s. vLLM serves none of them: registration would
fail and a failed load reads as -1, which wins every comparison. :class:`VllmSidecar` listens on
127.0.0.1, answers those from vLLM's own ``/metrics`` (requests running and waiting, KV usage x the
cache size) and forwards every other request to vLLM unchanged, one upstream connection per client
connection. Bodies are bounded (64 KiB in, 16 MiB out) and so is the number of client connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.request
from typing import Any

from triscope.errors import InputError
from triscope.prom_text import parse_exposition
from triscope_bed.ports import free_port

MAX_HEAD_BYTES = 16 * 1024
MAX_BODY_BYTES = 64 * 1024
MAX_ANSWER_BYTES = 16 * 1024 * 1024
MAX_CONNECTIONS = 512
SGLANG_GETS = ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load")


def vllm_load(metrics_text: str, kv_tokens: int) -> dict[str, int]:
    """SGLang's load report fields from vLLM's exposition: requests (running + waiting), waiting, KV tokens held."""
    series = parse_exposition(metrics_text, "vllm /metrics")
    values = {name: sum(v for _, v in series.get(name, [])) for name in
              ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}
    running = int(values.get("vllm:num_requests_running", 0))
    waiting = int(values.get("vllm:num_requests_waiting", 0))
    return {"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
            "num_tokens": int(round(values.get("vllm:kv_cache_usage_perc", 0.0) * kv_tokens))}


class VllmSidecar:
    """One sidecar for one vLLM server (``upstream_port``), served by an asyncio loop on a daemon thread."""

    def __init__(self, upstream_port: int, model: str, kv_tokens: int, max_running: int, port: int = 0) -> None:
        self.upstream_port = upstream_port
        self.model = model
        self.kv_tokens = kv_tokens
        self.max_running = max_running
        self.port = port or free_port()
        self.calls: dict[str, int] = {}
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"sidecar-{port}", daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmSidecar:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._client, "127.0.0.1", self.port, limit=MAX_HEAD_BYTES), self._loop)
        self._server = fut.result(10)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    async def _shutdown(self) -> None:
        """Close the listener and every client connection (their tasks end before the loop stops)."""
        if self._server is not None:
            self._server.close()
        for _ in range(3):  # a connection accepted while closing starts one more task
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if not tasks:
                break
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> VllmSidecar:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _info(self, path: str) -> Any:
        if path == "/get_load":
            with urllib.request.urlopen(f"http://127.0.0.1:{self.upstream_port}/metrics", timeout=2) as resp:
                return [vllm_load(resp.read().decode(), self.kv_tokens)]
        model = {"model_path": self.model, "tokenizer_path": self.model, "is_generation": True}
        if "model_info" in path:
            return model
        return {**model, "served_model_name": self.model, "version": "vllm", "tp_size": 1, "dp_size": 1,
                "max_running_requests": self.max_running, "max_total_num_tokens": self.kv_tokens}

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._slots.acquire(blocking=False):
            writer.close()
            return
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                head = await _read_head(reader)
                if head is None:
                    return
                method, path, headers, raw_head = head
                length = int(headers.get("content-length", "0") or 0)
                if length > MAX_BODY_BYTES:
                    await _answer(writer, 413, {"error": "body too large"}, close=True)
                    return
                body = await reader.readexactly(length) if length else b""
                route = path.split("?", 1)[0]
                if method == "GET" and route in SGLANG_GETS:
                    self.calls[route] = self.calls.get(route, 0) + 1
                    try:
                        doc = await asyncio.get_running_loop().run_in_executor(None, self._info, route)
                    except (OSError, ValueError, InputError) as exc:
                        await _answer(writer, 502, {"error": f"vllm metrics: {exc}"})
                        continue
                    await _answer(writer, 200, doc)
                    continue
                answer = None
                for fresh in (upstream is None, True):  # uvicorn drops idle keep-alives after 5 s: reconnect once
                    if fresh:
                        if upstream is not None:
                            upstream[1].close()
                        upstream = await asyncio.open_connection("127.0.0.1", self.upstream_port,
                                                                 limit=MAX_HEAD_BYTES)
                    assert upstream is not None
                    up_reader, up_writer = upstream
                    try:
                        up_writer.write(raw_head + body)
                        await up_writer.drain()
                        answer = await _read_head(up_reader)
                    except ConnectionError:
                        answer = None
                    if answer is not None or fresh:
                        break
                if answer is None:
                    return
                _, _, up_headers, up_raw = answer
                n = int(up_headers.get("content-length", "-1") or -1)
                if not 0 <= n <= MAX_ANSWER_BYTES:  # vLLM's JSON answers carry a length; nothing else is proxied
                    await _answer(writer, 502, {"error": "upstream answer without a bounded length"}, close=True)
                    return
                writer.write(up_raw + await up_reader.readexactly(n))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            return
        finally:
            self._slots.release()
            if upstream is not None:
                upstream[1].close()
            with contextlib.suppress(ConnectionError, RuntimeError):
                writer.close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes] | None:
    """(method or HTTP version, path or status, lower-cased headers, the raw head) or None at EOF."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = raw.decode("latin-1").split("\r\n")
    first = lines[0].split(" ", 2)
    if len(first) < 2:
        raise ValueError("bad request line")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return first[0], first[1], headers, raw


async def _answer(writer: asyncio.StreamWriter, status: int, doc: Any, close: bool = False) -> None:
    data = json.dumps(doc).encode()
    reason = {200: "OK", 413: "Payload Too Large", 502: "Bad Gateway"}.get(status, "OK")
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    writer.write((head + ("Connection: close\r\n" if close else "") + "\r\n").encode() + data)
    await writer.drain()
