#!/usr/bin/env bash
# Three NATS nodes on loopback (clients 4222-4224, routes 6222-6224, monitoring 8222-8224),
# JetStream stores under ${DM_NATS_CLUSTER_DIR:-/tmp/droidmesh-nats}/n1..n3. Ctrl-C stops all three.
# Then point every service at all of them:
#   export DM_NATS_URL=nats://127.0.0.1:4222,nats://127.0.0.1:4223,nats://127.0.0.1:4224
#   export DM_NATS_USER=admin DM_NATS_PASSWORD_FILE=/tmp/droidmesh-nats/admin-password
# The nodes' one login (node.conf): $DM_NATS_PASSWORD_ADMIN, or a fresh one kept in
# $DM_NATS_CLUSTER_DIR/admin-password (mode 600; the CLI takes DM_NATS_PASSWORD="$(cat that)").
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
nats_server="${NATS_SERVER:-$(command -v nats-server || echo "$here/../../../.venv/bin/nats-server")}"
base="${DM_NATS_CLUSTER_DIR:-/tmp/droidmesh-nats}"
mkdir -p "$base"
if [ -z "${DM_NATS_PASSWORD_ADMIN:-}" ]; then
  (umask 077; [ -s "$base/admin-password" ] || head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | sed 's/^/p/' > "$base/admin-password")
  DM_NATS_PASSWORD_ADMIN="$(cat "$base/admin-password")"
fi
export DM_NATS_PASSWORD_ADMIN
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT INT TERM
for i in 1 2 3; do
  mkdir -p "$base/n$i"
  DM_NATS_NODE="n$i" DM_NATS_LISTEN="127.0.0.1:422$((i + 1))" DM_NATS_HTTP="127.0.0.1:822$((i + 1))" \
  DM_NATS_STORE="$base/n$i" DM_NATS_CLUSTER_LISTEN="127.0.0.1:622$((i + 1))" \
  DM_NATS_ROUTE_1=nats://127.0.0.1:6222 DM_NATS_ROUTE_2=nats://127.0.0.1:6223 DM_NATS_ROUTE_3=nats://127.0.0.1:6224 \
    "$nats_server" -c "$here/node.conf" > "$base/n$i.log" 2>&1 &
  pids+=($!)
done
echo "3 nodes up; logs in $base/n{1,2,3}.log; healthy when curl -s 127.0.0.1:8222/healthz says ok"
wait
