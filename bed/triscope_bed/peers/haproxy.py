"""Start, query and stop a real HAProxy in front of the simulated backends (bench and tests)."""

from __future__ import annotations

import csv
import io
import json
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triscope.exporters.epp import Fallback
from triscope.exporters.haproxy_gate import LUA_PATH as GATE_LUA
from triscope.exporters.haproxy_gate import gate_rules
from triscope.exporters.haproxy_pick import (
    PICK_LOG_FORMAT,
    PickLogRecord,
    pick_globals,
    pick_rules,
    pick_stats_frontend,
)
from triscope_bed.peers.haproxy_log import read_request_log
from triscope_bed.ports import free_port, wait_port
from triscope_bed.procs import socket_dir, stop_process


@dataclass(frozen=True)
class PickSetup:
    """triscope's picker inside HAProxy: where its table is served, the action's settings, the poll period."""

    table_url: str
    settings: str
    poll_ms: int = 50
    fallback: Fallback | None = None
    """The answer to a request an admission level refused (None: the ``[epp]`` default)."""


@dataclass
class Server:
    name: str
    port: int
    host: str = "127.0.0.1"
    maxconn: int = 0
    """Per-server connection limit (0 = none); beyond it HAProxy queues in the backend."""
    weight: int = 100
    """Configured weight (1-256); an agent's ``NN%`` sets NN % of it."""


class HAProxy:
    """One HAProxy process: an HTTP frontend, one backend pool, an admin stats socket.

    ``agent_port`` set: every server gets ``agent-check`` against that port with
    ``agent-send "<name>\\n"`` (the triscope feed's HAProxy agent protocol). ``Server.maxconn``,
    ``timeout_queue_ms`` and ``queue_priority`` ({path suffix: priority class}) are admission
    control: requests beyond a server's maxconn wait in the backend queue, leave it by priority
    class, and get HAProxy's 503 after ``timeout queue``.

    ``class_pools`` (request class names, matched as the path's last segment): one more backend
    per class, ``pool_<class>``, with the same servers, chosen by ``use_backend``; with an agent
    each of its servers sends ``"<name> <class>"``, so the feed can close one backend to one class
    (triscope's ``admit_kv_ratio``). A pool whose servers are all drained answers 503 at once:
    per-class load shedding in the LB. Other paths keep using ``gpus``.

    ``pool_maxconn`` ({class: {server: n}}) caps a class pool's servers on their own (the class's
    requests in flight on that backend, enforced by HAProxy per request); ``pool_timeout_queue_ms``
    ({class: ms}) bounds the wait in that pool's queue.

    ``class_gate`` ({class: {server: limit}}) loads triscope's Lua gate
    (``exporters/haproxy_gate.lua``) into that class's pool: each request goes to the server with
    the fewest requests in flight (every pool summed) per unit of weight among those below their
    limit, or gets HAProxy's 503 when none is.
    """

    def __init__(self, workdir: Path, servers: list[Server], balance: str = "roundrobin",
                 agent_port: int | None = None, agent_inter_ms: int = 250, port: int | None = None,
                 binary: str | None = None, timeout_queue_ms: int = 0,
                 queue_priority: dict[str, int] | None = None, class_pools: list[str] | tuple[str, ...] = (),
                 pool_maxconn: dict[str, dict[str, int]] | None = None,
                 pool_timeout_queue_ms: dict[str, int] | None = None,
                 class_gate: dict[str, dict[str, float]] | None = None, health_check_ms: int = 0,
                 retries: int | None = None, pick: PickSetup | None = None, nbthread: int = 1) -> None:
        self.workdir = Path(workdir)
        self.pick = pick
        """Set: triscope's per-request picker (``exporters/haproxy_pick.lua``) chooses in the ``gpus`` pool."""
        self.health_check_ms = health_check_ms
        """> 0: ``option httpchk GET /health`` and ``check inter N fall 3 rise 2`` on every server."""
        self.retries = retries
        """HAProxy's ``retries`` (None: its default of 3 connection retries)."""
        self.nbthread = nbthread
        """HAProxy's threads (1: every pick of the Lua picker sees the previous one's connection counted)."""
        self.servers = servers
        self.balance = balance
        self.agent_port = agent_port
        self.agent_inter_ms = agent_inter_ms
        self.timeout_queue_ms = timeout_queue_ms
        self.queue_priority = dict(queue_priority or {})
        self.class_pools = tuple(class_pools)
        self.pool_maxconn = {c: dict(v) for c, v in (pool_maxconn or {}).items()}
        self.pool_timeout_queue_ms = dict(pool_timeout_queue_ms or {})
        self.class_gate = {c: dict(v) for c, v in (class_gate or {}).items()}
        limited = set(self.pool_maxconn) | set(self.pool_timeout_queue_ms) | set(self.class_gate)
        unknown = limited - set(self.class_pools)
        if unknown:
            raise ValueError(f"pool limits for classes without a pool: {', '.join(sorted(unknown))}")
        self.port = port or free_port()
        self.pick_stats_port = free_port() if pick is not None else 0
        self.binary = binary or shutil.which("haproxy") or "haproxy"
        # HAProxy binds "<path>.<pid>.tmp" first, then renames it: room for the suffix too
        self.socket_path = socket_dir(self.workdir.resolve(), len("/haproxy.sock.4194304.tmp")) / "haproxy.sock"
        self.config_path = self.workdir / "haproxy.cfg"
        self.proc: subprocess.Popen | None = None

    def config_text(self) -> str:
        lines = [
            "global",
            "    maxconn 4000",
            f"    stats socket {self.socket_path} mode 600 level admin",
            f"    nbthread {self.nbthread}",
            "    log stdout format raw local0",
        ]
        if self.class_gate:
            lines.append(f"    lua-load {GATE_LUA}")
        if self.pick is not None:
            lines += ["    " + line for line in pick_globals(self.pick.table_url, self.pick.poll_ms)]
        lines += [
            "defaults",
            "    mode http",
            "    timeout connect 2s",
            "    timeout client 120s",
            "    timeout server 120s",
            "    option http-keep-alive",
            *([f"    retries {self.retries}"] if self.retries is not None else []),
            *(["    option httpchk GET /health"] if self.health_check_ms > 0 else []),
            "frontend fe",
            f"    bind 127.0.0.1:{self.port}",
            "    log global",  # one line per request (and the picker's factors), read by request_log()
            "    option dontlognull",  # not the connections that sent nothing (wait_port's)
            f"    log-format \"{PICK_LOG_FORMAT}\"",
        ]
        lines += [f"    use_backend pool_{c} if {{ path_end /{c} }}" for c in self.class_pools]
        lines.append("    default_backend gpus")
        if self.pick is not None:  # the picker's counters (polls of its table, picks, fallbacks)
            lines += pick_stats_frontend(self.pick_stats_port)
        lines += self._pool("gpus", "")
        for c in self.class_pools:
            lines += self._pool(f"pool_{c}", c)
        return "\n".join(lines) + "\n"

    def _pool(self, pool: str, request_class: str) -> list[str]:
        lines = [f"backend {pool}", f"    balance {self.balance}"]
        timeout_queue_ms = self.pool_timeout_queue_ms.get(request_class, self.timeout_queue_ms)
        if timeout_queue_ms > 0:
            lines.append(f"    timeout queue {timeout_queue_ms}ms")
        caps = self.pool_maxconn.get(request_class, {})
        for suffix, prio in self.queue_priority.items():  # lower class leaves HAProxy's queue first
            lines.append(f"    http-request set-priority-class int({prio}) if {{ path_end /{suffix} }}")
        if self.pick is not None and pool == "gpus":
            lines += ["    " + line for line in pick_rules(self.pools, [s.name for s in self.servers],
                                                            self.pick.settings, self.pick.fallback)]
        gate = self.class_gate.get(request_class)
        if gate is not None:
            lines += ["    " + line for line in gate_rules(self.pools, gate, [s.name for s in self.servers])]
        for s in self.servers:
            line = f"    server {s.name} {s.host}:{s.port} weight {s.weight}"
            maxconn = caps.get(s.name, s.maxconn)
            if maxconn > 0:
                line += f" maxconn {maxconn}"
            if self.health_check_ms > 0:
                line += f" check inter {self.health_check_ms}ms fall 3 rise 2"
            if self.agent_port is not None:
                send = f"{s.name} {request_class}" if request_class else s.name
                line += (f" agent-check agent-addr 127.0.0.1 agent-port {self.agent_port}"
                         f" agent-inter {self.agent_inter_ms}ms agent-send \"{send}\\n\"")
            lines.append(line)
        return lines

    @property
    def pools(self) -> list[str]:
        """Every backend pool: ``gpus`` then one per class."""
        return ["gpus"] + [f"pool_{c}" for c in self.class_pools]

    def start(self) -> HAProxy:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.config_text())
        check = subprocess.run([self.binary, "-c", "-q", "-f", str(self.config_path)],
                               capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy rejected its config: {check.stderr.strip() or check.stdout.strip()}")
        log = open(self.workdir / "haproxy.log", "wb")  # noqa: SIM115 - owned by the process lifetime
        self.proc = subprocess.Popen([self.binary, "-db", "-f", str(self.config_path)],
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            wait_port(self.port, proc=self.proc)
        except (TimeoutError, RuntimeError) as exc:
            self.stop()
            tail = (self.workdir / "haproxy.log").read_text(errors="replace")[-1500:]
            raise RuntimeError(f"haproxy did not start: {exc}: {tail.strip()}") from None
        deadline = time.monotonic() + 5
        while not self.socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def request_log(self) -> list[PickLogRecord]:
        """One record per request HAProxy finished, in the order logged (with the picker's factors when
        ``pick`` is set; without it those fields are empty)."""
        return read_request_log(self.workdir / "haproxy.log")

    def pick_stats(self) -> dict[str, Any]:
        """The Lua picker's counters: table polls (and failed ones), picks, picks left to the balance."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.pick_stats_port}/", timeout=2.0) as answer:
            stats: dict[str, Any] = json.loads(answer.read())
        return stats

    def admin(self, command: str) -> str:
        """One command on the stats socket; returns its text answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(str(self.socket_path))
            s.sendall(command.encode() + b"\n")
            chunks = []
            while True:
                data = s.recv(65536)
                if not data:
                    break
                chunks.append(data)
        return b"".join(chunks).decode()

    def stats(self, pool: str | None = "gpus") -> list[dict[str, str]]:
        """``show stat`` rows of the servers of ``pool`` (every pool when None)."""
        text = self.admin("show stat").lstrip("# ")
        rows = list(csv.DictReader(io.StringIO(text)))
        wanted = set(self.pools) if pool is None else {pool}
        return [r for r in rows if r.get("pxname") in wanted and r.get("svname") not in ("FRONTEND", "BACKEND")]

    def weights(self, pool: str = "gpus") -> dict[str, int]:
        """Current effective weight of every server of ``pool`` (what the agent set)."""
        out = {}
        for s in self.servers:
            answer = self.admin(f"get weight {pool}/{s.name}").split()
            out[s.name] = int(answer[0]) if answer and answer[0].isdigit() else -1
        return out

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def __enter__(self) -> HAProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
