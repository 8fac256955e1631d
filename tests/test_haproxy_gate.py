"""triscope's HAProxy Lua batch gate (exporters/haproxy_gate.lua) in a real HAProxy on 127.0.0.1.

Two plain HTTP backends that hold a request until the test releases it, so the requests in
flight on each backend are known; HAProxy has one pool per class (``a`` and ``v``) over the same
two servers, and the gate sits in pool ``v`` with a limit per server on the requests in flight
on that backend from every pool together.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import require_binary

pytestmark = pytest.mark.integration


class _Holder:
    """An HTTP backend answering 200 with its name; ``?hold=1`` requests wait for ``release``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.release = threading.Event()
        holder = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if "hold=1" in self.path:
                    holder.release.wait(20)
                body = holder.name.encode()
                self.send_response(200)
                self.send_header("X-Backend", holder.name)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _get(port: int, path: str) -> tuple[int, str]:
    """(status, X-Backend) of one GET through HAProxy."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:
            return resp.status, resp.headers.get("X-Backend", "")
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("X-Backend", "")


def _in_flight(hap, name: str) -> int:
    return sum(int(r["scur"] or 0) for r in hap.stats(None) if r["svname"] == name)


def _hold(hap, path: str, holds: list[threading.Thread], name: str, expect: int) -> None:
    """Send a held request and wait until HAProxy counts ``expect`` in flight on ``name``."""
    t = threading.Thread(target=_get, args=(hap.port, path), daemon=True)
    t.start()
    holds.append(t)
    deadline = time.monotonic() + 5
    while _in_flight(hap, name) < expect:
        assert time.monotonic() < deadline, f"{name} never had {expect} requests in flight"
        time.sleep(0.01)


def test_gate_counts_every_pool_and_sheds_when_no_backend_is_below_its_limit(tmp_path: Path) -> None:
    require_binary("haproxy")
    from triscope_bed.peers.haproxy import HAProxy, Server

    b0, b1 = _Holder("b0"), _Holder("b1")
    holds: list[threading.Thread] = []
    hap = HAProxy(tmp_path, [Server("b0", b0.port), Server("b1", b1.port)], balance="leastconn",
                  class_pools=["a", "v"], class_gate={"v": {"b0": 1, "b1": 2}})
    try:
        hap.start()
        assert _get(hap.port, "/v") == (200, "b0"), "both idle: the first by name"
        # A held request of class a on b0 (pool a): b0 reaches its limit of 1 for class v.
        hap.admin("set server pool_a/b1 state maint")
        _hold(hap, "/a?hold=1", holds, "b0", 1)
        hap.admin("set server pool_a/b1 state ready")
        assert [_get(hap.port, "/v")[1] for _ in range(3)] == ["b1"] * 3, "b0 is at its limit"
        _hold(hap, "/v?hold=1", holds, "b1", 1)  # b1: 1 in flight, still below its limit of 2
        assert _get(hap.port, "/v") == (200, "b1")
        _hold(hap, "/v?hold=1", holds, "b1", 2)
        status, backend = _get(hap.port, "/v")
        assert (status, backend) == (503, ""), "no backend below its limit: HAProxy sheds the class at once"
        assert _get(hap.port, "/a")[0] == 200, "other classes are not gated"
        b0.release.set()
        b1.release.set()
        for t in holds:
            t.join(10)
        assert _get(hap.port, "/v") == (200, "b0")
        # What the agent says still counts: a drained server or one at weight 0 is never picked.
        hap.admin("set server pool_v/b0 state drain")
        assert {_get(hap.port, "/v")[1] for _ in range(3)} == {"b1"}
        hap.admin("set server pool_v/b0 state ready")
        hap.admin("set weight pool_v/b1 0")
        assert {_get(hap.port, "/v")[1] for _ in range(3)} == {"b0"}
        hap.admin("set server pool_v/b0 state drain")
        assert _get(hap.port, "/v") == (503, "")
    finally:
        hap.stop()
        b0.close()
        b1.close()


def test_gate_needs_a_class_pool(tmp_path: Path) -> None:
    from triscope_bed.peers.haproxy import HAProxy, Server

    with pytest.raises(ValueError, match="without a pool: v"):
        HAProxy(tmp_path, [Server("b0", 1)], class_pools=["a"], class_gate={"v": {"b0": 1}})


def test_cli_prints_gate_lines_haproxy_accepts_with_limits_from_the_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``triscope weights haproxy-gate``: limit = admit_batch_ratio x max_num_seqs per backend,
    under its HAProxy server name; the lines, placed in a whole config, pass ``haproxy -c``."""
    haproxy = require_binary("haproxy")
    import json
    import subprocess

    from triscope.cli import main

    cfg = tmp_path / "triscope.toml"
    cfg.write_text('[weights.classes.offline_video]\nadmit_batch_ratio = 0.375\n'
                   '[weights.backends."gpu-a:8000"]\nmax_num_seqs = 16\n'
                   '[weights.backends."gpu-b:8000"]\nmax_num_seqs = 8\n'
                   '[weights.backends."gpu-c:8000"]\n')  # no max_num_seqs: the agent alone decides
    servers = ["--server", "gpu-a:8000=gpu-a", "--server", "gpu-b:8000=gpu-b"]
    pools = ["--pool", "offline_video=video", "--pool", "realtime_speech=gpus"]
    assert main(["weights", "haproxy-gate", "-c", str(cfg), *servers, *pools, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["limits"] == {"offline_video": {"gpu-a": 6.0, "gpu-b": 3.0}}
    assert Path(doc["lua_path"]).is_file()
    lines = doc["config"].splitlines()
    assert "    http-request lua.triscope_gate gpus,video gpu-a=6,gpu-b=3" in lines
    frontend = ["defaults", "    mode http", "    timeout connect 1s", "    timeout client 5s", "    timeout server 5s",
                "frontend fe", "    bind 127.0.0.1:18080", "    use_backend video if { path_end /offline_video }",
                "    default_backend gpus", "backend gpus", "    server gpu-a 127.0.0.1:9001",
                "    server gpu-b 127.0.0.1:9002"]
    full = lines[:2] + frontend + lines[2:] + ["    server gpu-a 127.0.0.1:9001", "    server gpu-b 127.0.0.1:9002"]
    (tmp_path / "h.cfg").write_text("\n".join(full) + "\n")
    check = subprocess.run([haproxy, "-c", "-f", str(tmp_path / "h.cfg")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    assert main(["weights", "haproxy-gate", "-c", str(cfg), "--server", "nope=x"]) == 2
    assert "no [weights.backends] entry for nope" in capsys.readouterr().err
    bare = tmp_path / "bare.toml"
    bare.write_text('[weights.backends.b0]\nmax_num_seqs = 4\n')
    assert main(["weights", "haproxy-gate", "-c", str(bare)]) == 2
    assert "no class has admit_batch_ratio" in capsys.readouterr().err
    assert main(["weights", "haproxy-gate", "--lua-path"]) == 0
    assert capsys.readouterr().out.strip().endswith("haproxy_gate.lua")
