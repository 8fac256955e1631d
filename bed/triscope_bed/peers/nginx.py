"""nginx as a same-run baseline for the feed benches: one worker on 127.0.0.1, no daemon, everything
under ``prefix`` (bench/feed.py serves the feed's JSON over HTTP, bench/agent.py a line over TCP)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from triscope_bed.ports import free_port, wait_port
from triscope_bed.procs import stop_process

STREAM_MODULE = Path("/usr/lib/nginx/modules/ngx_stream_module.so")
"""Debian's dynamic stream module (package libnginx-mod-stream)."""


class Nginx:
    """nginx with the top-level ``block(port)`` (an ``http {}`` or ``stream {}`` section) after the common
    head; ``modules`` are loaded first (a missing one is a one-line exit naming its package); temporary
    files go to ``prefix/tmp``."""

    def __init__(self, prefix: Path, block: Callable[[int], str], modules: Sequence[Path] = (),
                 worker_connections: int = 1024) -> None:
        self.prefix, self.block, self.modules, self.worker_connections = prefix, block, modules, worker_connections
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Nginx:
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(binary).exists():
            raise SystemExit("nginx is not installed (Debian package nginx)")
        missing = [str(m) for m in self.modules if not m.exists()]
        if missing:
            raise SystemExit(f"nginx module {', '.join(missing)} is not installed "
                             "(Debian package libnginx-mod-stream for the stream module)")
        for d in ("logs", "tmp"):
            (self.prefix / d).mkdir(parents=True, exist_ok=True)
        conf = self.prefix / "nginx.conf"
        loads = "".join(f"load_module {m};\n" for m in self.modules)
        conf.write_text(f"""{loads}
daemon off;
master_process off;
worker_processes 1;
pid {self.prefix}/nginx.pid;
error_log {self.prefix}/logs/error.log warn;
events {{ worker_connections {self.worker_connections}; }}
{self.block(self.port)}
""")
        self.proc = subprocess.Popen([binary, "-p", str(self.prefix), "-c", str(conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_port(self.port, proc=self.proc)
        return self

    def stop(self) -> None:
        stop_process(self.proc)
