"""The two server stacks of the daemon, side by side: requests/s and p99 with N keep-alive clients.

    .venv/bin/python bench/http_stack.py [--connections 8 64] [--duration-s 5] [--json OUT]

Each stack runs in a process of its own serving the same 1 KiB JSON document on ``GET /doc``:

* ``threaded``: a thread per connection with ``http.server``'s HTTP/1.1 handler (what OTLP,
  ``/metrics`` and the query endpoint ran on, bounded, until this measurement put them on the loop;
  now ``http.server.ThreadingHTTPServer``, the same per-request machinery without the bounds): head
  and body in two writes, so Nagle's algorithm holds the body until the client's delayed ACK
  (~40 ms on Linux);
* ``threaded-nodelay``: the same with ``TCP_NODELAY``;
* ``loop``: the server kit (:class:`triscope.loop_server.LoopServer` with the feed's HTTP/1.1
  connection, uvloop when installed), every server of the daemon now.

``wrk`` (2 threads) drives each for ``--duration-s`` after a one-second warm-up, with every
``--connections`` count. Ratios are loop over each threaded variant, from the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DOC = json.dumps({"backends": {f"gpu-{i}:8000": {"weight": 100 + i, "state": "ready"} for i in range(24)}}).encode()
_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
STACKS = ("threaded", "threaded-nodelay", "loop")


def serve(stack: str, port_file: Path) -> None:
    """Serve DOC with ``stack`` until killed, writing the port to ``port_file``."""
    if stack.startswith("threaded"):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = stack == "threaded-nodelay"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(DOC)))
                self.end_headers()
                self.wfile.write(DOC)

        class Quiet(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: object, client_address: object) -> None:
                pass  # wrk hangs up at its end

        server = Quiet(("127.0.0.1", 0), Handler)
        port = server.server_address[1]
        port_file.write_text(str(port))
        server.serve_forever(poll_interval=0.2)
        return
    from triscope.exporters.feed_server import FeedHTTPServer, encode

    class DocServer(FeedHTTPServer):
        max_body_bytes = 1 << 20  # type: ignore[assignment]

        def response(self, method: str, path: str, body: bytes, close: bool) -> bytes:
            return encode(200, "application/json", DOC, close)

    loop_server = DocServer(None, "127.0.0.1", 0, 1024).start()
    port_file.write_text(str(loop_server.port))
    while True:
        time.sleep(3600)


def wrk(url: str, connections: int, duration_s: float) -> dict[str, float]:
    exe = shutil.which("wrk")
    if exe is None:
        raise SystemExit("wrk is not installed (Debian package wrk)")
    proc = subprocess.run([exe, "-t2", f"-c{connections}", f"-d{duration_s:g}s", "--latency", url],
                          capture_output=True, text=True, timeout=duration_s + 30, check=True)
    out = {"rps": math.nan, "p50_s": math.nan, "p99_s": math.nan, "errors": 0.0}
    if m := re.search(r"Requests/sec:\s+([\d.]+)", proc.stdout):
        out["rps"] = float(m.group(1))
    for pct in ("50", "99"):
        if m := re.search(rf"^\s+{pct}(?:\.000)?%\s+([\d.]+)(us|ms|s)", proc.stdout, re.MULTILINE):
            out[f"p{pct}_s"] = float(m.group(1)) * _UNIT[m.group(2)]
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", proc.stdout):
        out["errors"] = float(sum(int(g) for g in m.groups()))
    if m := re.search(r"Non-2xx or 3xx responses:\s+(\d+)", proc.stdout):
        out["errors"] += float(m.group(1))
    return out


def measure(stack: str, connections: list[int], duration_s: float, tmp: Path) -> dict[int, dict[str, float]]:
    port_file = tmp / f"{stack}.port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, __file__, "--serve", stack, "--port-file", str(port_file)])
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{stack} server did not start")
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text()}/doc"
        out = {}
        for n in connections:
            wrk(url, n, 1)  # warm-up
            out[n] = wrk(url, n, duration_s)
        return out
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--duration-s", type=float, default=5.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--serve", choices=STACKS, help=argparse.SUPPRESS)
    ap.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port_file)
        return {}
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        res = {stack: measure(stack, args.connections, args.duration_s, Path(tmp)) for stack in STACKS}
    doc: dict[str, Any] = {"body_bytes": len(DOC), "duration_s": args.duration_s, **res}
    for base in STACKS[:2]:
        doc[f"ratio_loop_over_{base}"] = {
            n: {"rps": round(res["loop"][n]["rps"] / res[base][n]["rps"], 2),
                "p99": round(res["loop"][n]["p99_s"] / res[base][n]["p99_s"], 3)} for n in args.connections}
    print(json.dumps(doc, indent=1))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()
