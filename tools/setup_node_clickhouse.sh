#!/usr/bin/env bash
# Install ClickHouse's official JavaScript client (@clickhouse/client, npm) for
# tests/test_query_endpoint.py: a real client of the daemon's query endpoint (docs/query.md).
# Idempotent. Folder: $TRISCOPE_NODE_CLICKHOUSE, default var/node-clickhouse.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=1.23.1
dir=${TRISCOPE_NODE_CLICKHOUSE:-var/node-clickhouse}
if [ -f "$dir/node_modules/@clickhouse/client/package.json" ] \
        && grep -q "\"version\": \"$VERSION\"" "$dir/node_modules/@clickhouse/client/package.json"; then
    echo "@clickhouse/client $VERSION already in $dir" >&2
    exit 0
fi
if ! command -v npm >/dev/null; then
    echo "error: npm not found (Node.js 20 with npm is needed)" >&2
    exit 1
fi
npm install --silent --no-audit --no-fund --prefix "$dir" "@clickhouse/client@$VERSION"
echo "@clickhouse/client $VERSION installed in $dir" >&2
