#!/usr/bin/env bash
# Install sglang-router (a Rust load balancer shipped in a wheel) in a virtualenv of its own: the real
# peer LB of the closed-loop bench and tests/test_peer_sglang_router.py (docs/peers.md).
# Idempotent: a finished install leaves a stamp and the next call only prints the venv's python.
# Venv: $TRISCOPE_SGLANG_ROUTER_VENV, default var/sglang-router-venv (relative to the repository root).
set -euo pipefail
cd "$(dirname "$0")/.."

ROUTER_VERSION=0.3.2
venv=${TRISCOPE_SGLANG_ROUTER_VENV:-var/sglang-router-venv}
py=$venv/bin/python
stamp=$venv/.triscope-sglang-router-$ROUTER_VERSION

if [ -f "$stamp" ] && "$py" -c "import importlib.metadata as m; assert m.version('sglang-router') == '$ROUTER_VERSION'" \
        2>/dev/null; then
    echo "sglang-router $ROUTER_VERSION already in $venv" >&2
    realpath -s "$py"
    exit 0
fi
base=$(command -v python3.11 || true)
if [ -z "$base" ] && python3 -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
    base=$(command -v python3)
fi
if [ -z "$base" ]; then
    echo "error: python3.11 not found (the sglang-router venv is made with it)" >&2
    exit 1
fi
# pip warns once per package about local index folders that do not hold it: noise, not errors.
pip_install() {
    "$py" -m pip install -q "$@" 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}
start=$(date +%s)
[ -x "$py" ] || "$base" -m venv "$venv"
pip_install "sglang-router==$ROUTER_VERSION"
# Its declared dependencies are small (aiohttp, fastapi, uvicorn, orjson, setproctitle); a resolve that
# pulls torch would mean a wrong version or index: refuse rather than carry gigabytes.
"$py" - "$ROUTER_VERSION" <<'PY'
import importlib.metadata as md
import importlib.util
import sys

assert md.version("sglang-router") == sys.argv[1], md.version("sglang-router")
heavy = [d for d in ("torch", "sglang", "vllm") if importlib.util.find_spec(d) is not None]
assert not heavy, f"sglang-router's install pulled {heavy}"
import sglang_router.launch_router  # noqa: F401,E402 - the entry point the bench runs
print(f"sglang-router {md.version('sglang-router')}", file=sys.stderr)
PY
"$py" -m sglang_router.launch_router --help >/dev/null
touch "$stamp"
echo "sglang-router $ROUTER_VERSION installed in $venv in $(( $(date +%s) - start )) s ($(du -sh "$venv" | cut -f1))" >&2
realpath -s "$py"
