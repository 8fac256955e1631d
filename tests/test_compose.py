"""compose/: the stack file against the official Compose JSON schema, no default credentials,
127.0.0.1-only ports, mounted paths present, and the triscope/Prometheus configs it mounts are valid.

The schema is the Compose specification's JSON schema as Debian's ``docker-compose`` package
ships it (CI installs it from .ci/apt-packages.txt); ``docker-compose config`` then checks the
file with a real Compose implementation, interpolation included. No Docker daemon is needed.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.conftest import REPO, require, require_binary
from triscope.analyzers.routing import WeightParams
from triscope.config import load_config
from triscope.exporters.feed import WeightFeed
from triscope.exporters.prometheus import prometheus_config
from triscope.registry import COLLECTORS, EXPORTERS, resolve

COMPOSE = REPO / "compose"
FILES = ("compose.yaml", "compose.gpu.yaml")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|PASSWD|API_?KEY|CREDENTIAL", re.IGNORECASE)
REQUIRED_REF = re.compile(r"\$\{[A-Z_][A-Z0-9_]*:\?[^}]+\}")
ANY_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}")


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((COMPOSE / name).read_text())


def _strings(node: Any) -> list[str]:
    """Every string value (and key) of a loaded YAML document: what compose interpolates."""
    if isinstance(node, dict):
        return [x for k, v in node.items() for x in (*_strings(k), *_strings(v))]
    if isinstance(node, list):
        return [x for v in node for x in _strings(v)]
    return [node] if isinstance(node, str) else []


SPEC_SCHEMA = Path("/usr/lib/python3/dist-packages/compose/config/compose_spec.json")


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    require(SPEC_SCHEMA.is_file(), f"{SPEC_SCHEMA} (Debian package docker-compose) is absent")
    schema = json.loads(SPEC_SCHEMA.read_text())
    assert "2019-09" in schema["$schema"], schema["$schema"]
    jsonschema.Draft201909Validator.check_schema(schema)
    return jsonschema.Draft201909Validator(schema)


@pytest.fixture(scope="module")
def stack() -> dict[str, Any]:
    return _load("compose.yaml")


@pytest.mark.parametrize("name", FILES)
def test_valid_against_the_compose_spec_schema(validator: jsonschema.protocols.Validator, name: str) -> None:
    errors = sorted(validator.iter_errors(_load(name)), key=lambda e: list(e.absolute_path))
    assert not errors, "; ".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_the_schema_rejects_what_compose_rejects(validator: jsonschema.protocols.Validator,
                                                 stack: dict[str, Any]) -> None:
    bad = json.loads(json.dumps(stack))
    bad["services"]["clickhouse"]["helthcheck"] = {"test": "true"}  # misspelt key
    bad["services"]["grafana"]["ports"] = [{"target": 3000, "host_ip": ["not-a-string"]}]
    messages = " ".join(e.message for e in validator.iter_errors(bad))
    assert "'helthcheck' does not match" in messages and "'host_ip': ['not-a-string']} is not valid" in messages


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): str(v) for k, v in env.items()}


def test_no_default_credentials(stack: dict[str, Any]) -> None:
    secrets = {}
    for name, service in stack["services"].items():
        for key, value in _env(service).items():
            if SECRET_NAME.search(key):
                secrets[f"{name}.{key}"] = value
    assert {"clickhouse.CLICKHOUSE_PASSWORD", "grafana.GF_SECURITY_ADMIN_PASSWORD",
            "triscope.TRISCOPE_STORE__PASSWORD"} <= set(secrets)
    for where, value in secrets.items():
        assert REQUIRED_REF.fullmatch(value), f"{where} = {value!r} is not a required ${{VAR:?message}} reference"
    texts = {name: "\n".join(_strings(_load(name))) for name in FILES}
    texts.update({name: (COMPOSE / name).read_text() for name in ("triscope.toml", "prometheus.yml", "Dockerfile")})
    for name, text in texts.items():
        for var, op, default in ANY_REF.findall(text):
            if SECRET_NAME.search(var):
                assert op == ":?", f"{name}: ${{{var}}} must be required (:?), got {op!r}{default!r}"
    config = load_config(COMPOSE / "triscope.toml", environ={})
    assert config["store"]["password"] == "" and config["store"]["username"] == ""
    assert not config.get("otlp", {}).get("token")
    prometheus_yml = (COMPOSE / "prometheus.yml").read_text()
    assert not re.search(r"(?im)^\s*(password|basic_auth|bearer_token)\s*[:=]", prometheus_yml)


def test_required_variables_are_exactly_the_passwords(stack: dict[str, Any]) -> None:
    refs = [ref for text in _strings(stack) for ref in ANY_REF.findall(text)]
    required = {var for var, op, _ in refs if op == ":?"}
    assert {var for var, _, _ in refs} == required | {"CLICKHOUSE_USER", "GRAFANA_ADMIN_USER"}
    assert required == {"CLICKHOUSE_PASSWORD", "GRAFANA_ADMIN_PASSWORD"}


def _host_ips(port: Any) -> str:
    if isinstance(port, dict):
        return str(port.get("host_ip", ""))
    parts = str(port).rsplit(":", 2)
    return parts[0] if len(parts) == 3 else ""


def test_every_published_port_is_loopback_only(stack: dict[str, Any]) -> None:
    published = [(name, p) for name, s in stack["services"].items() for p in s.get("ports", [])]
    assert len(published) >= 6
    for name, port in published:
        assert _host_ips(port) == "127.0.0.1", f"{name}: port {port!r} is not bound to 127.0.0.1"
    for service in stack["services"].values():
        assert service.get("network_mode") != "host"


def test_mounted_paths_and_build_files_exist(stack: dict[str, Any]) -> None:
    declared = set(stack.get("volumes") or {})
    binds = []
    for name, service in stack["services"].items():
        for vol in service.get("volumes", []):
            source = vol["source"] if isinstance(vol, dict) else str(vol).split(":", 1)[0]
            if source.startswith((".", "/")):
                binds.append((name, source))
                assert (COMPOSE / source).resolve().exists(), f"{name}: mounted {source} is not in the repo"
            else:
                assert source in declared, f"{name}: named volume {source} is not declared"
    assert ("grafana", "../dashboards/provisioning") in binds and ("grafana", "../dashboards/json") in binds
    build = stack["services"]["triscope"]["build"]
    context = (COMPOSE / build["context"]).resolve()
    dockerfile = context / build["dockerfile"]
    assert context == REPO and dockerfile.is_file()
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (context / src).exists(), f"Dockerfile copies {src}, which is not in the repo"


def test_triscope_config_matches_the_stack(stack: dict[str, Any]) -> None:
    config = load_config(COMPOSE / "triscope.toml", environ={})
    assert config["store"]["backend"] == "server"
    assert config["store"]["url"] == "http://clickhouse:8123" and "clickhouse" in stack["services"]
    for name in config["run"]["collectors"]:
        resolve(name, COLLECTORS, "collector")
    assert config["run"]["exporters"] == ["prometheus", "weights_feed"]
    for name in config["run"]["exporters"]:
        resolve(name, EXPORTERS, "exporter")
    prom = prometheus_config(config)
    feed = WeightParams.from_config(config).feed
    assert feed["bind"] == "0.0.0.0" and feed["port"] > 0 and feed["agent_port"] > 0
    service = stack["services"]["triscope"]
    for port in (prom["port"], feed["port"], feed["agent_port"]):
        assert f"127.0.0.1:{port}:{port}" in service["ports"]
    assert f"127.0.0.1:{config['otlp']['port']}:{config['otlp']['port']}" in service["ports"]
    mounted = {str(v).split(":")[1] for v in service["volumes"] if str(v).startswith("./triscope.toml")}
    command = service["command"]
    assert command[:2] == ["triscope", "run"] and command[command.index("--config") + 1] in mounted
    assert config["writer"]["spool_dir"].startswith("/var/lib/triscope")
    assert any(str(v).endswith(":/var/lib/triscope") for v in service["volumes"])
    env = _env(service)  # the password reaches the store through the TRISCOPE_* override
    overridden = load_config(COMPOSE / "triscope.toml", environ={"TRISCOPE_STORE__PASSWORD": "s3cr-t"})
    assert overridden["store"]["password"] == "s3cr-t" and "TRISCOPE_STORE__PASSWORD" in env
    jobs = {job["job_name"]: job for job in yaml.safe_load((COMPOSE / "prometheus.yml").read_text())["scrape_configs"]}
    targets = {name: [t for sc in jobs[name]["static_configs"] for t in sc["targets"]]
               for name in ("triscope", "triscope_weights")}
    assert targets == {"triscope": [f"triscope:{prom['port']}"], "triscope_weights": [f"triscope:{feed['port']}"]}
    assert jobs["triscope_weights"].get("metrics_path", "/metrics") == "/metrics"


def test_weight_feed_serves_what_prometheus_scrapes() -> None:
    """The feed as compose configures it (but on 127.0.0.1 and ephemeral ports here) answers the
    scrape path of the ``triscope_weights`` job with its metric families."""
    config = load_config(COMPOSE / "triscope.toml", environ={})
    job = next(j for j in yaml.safe_load((COMPOSE / "prometheus.yml").read_text())["scrape_configs"]
               if j["job_name"] == "triscope_weights")
    feed = WeightFeed(WeightParams.from_config(config), inputs_fn=list, bind="127.0.0.1", port=0,
                      agent_port=0).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", feed.http_port, timeout=5)
        conn.request("GET", job.get("metrics_path", "/metrics"))
        resp = conn.getresponse()
        body = resp.read().decode()
        conn.close()
    finally:
        feed.close()
    assert resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/plain")
    assert "# TYPE triscope_weights_updates_total counter" in body


def test_prometheus_config_passes_promtool() -> None:
    promtool = require_binary("promtool")
    res = subprocess.run([promtool, "check", "config", str(COMPOSE / "prometheus.yml")],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr


def test_docker_compose_accepts_the_files_with_the_passwords_set() -> None:
    """A real Compose implementation parses and interpolates the stack (no daemon needed)."""
    binary = require_binary("docker-compose")
    env = {"PATH": os.environ.get("PATH", ""), "CLICKHOUSE_PASSWORD": "p1", "GRAFANA_ADMIN_PASSWORD": "p2"}
    files = [arg for name in FILES for arg in ("-f", str(COMPOSE / name))]
    res = subprocess.run([binary, *files, "config", "-q"], capture_output=True, text=True, env=env,
                         cwd=COMPOSE, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    missing = subprocess.run([binary, *files, "config", "-q"], capture_output=True, text=True,
                             env={"PATH": env["PATH"]}, cwd=COMPOSE, timeout=60)
    assert missing.returncode != 0 and "CLICKHOUSE_PASSWORD" in missing.stderr


def test_grafana_gets_every_variable_its_provisioning_uses(stack: dict[str, Any]) -> None:
    files = sorted((REPO / "dashboards" / "provisioning").rglob("*.y*ml"))
    assert files, "dashboards/provisioning has no YAML files"
    used = set()
    for path in files:
        text = "\n".join(_strings(yaml.safe_load(path.read_text())))
        used |= set(re.findall(r"\$(?:__env)?\{([A-Za-z_][A-Za-z0-9_]*)\}", text))
    env = _env(stack["services"]["grafana"])
    assert used and used <= set(env), f"not set for grafana: {sorted(used - set(env))}"
    assert REQUIRED_REF.fullmatch(env["TRISCOPE_CLICKHOUSE_PASSWORD"])
    assert env["TRISCOPE_CLICKHOUSE_HOST"] in stack["services"]
    assert env["TRISCOPE_PROMETHEUS_URL"].split("//")[1].split(":")[0] in stack["services"]
