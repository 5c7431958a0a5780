#!/usr/bin/env bash
# Print fresh random NATS passwords for every role, as env assignments.
set -euo pipefail
for role in SENDER BROKER RECEIVER PROFILER CLIENT GATEWAY ADMIN; do
  echo "DM_NATS_PASSWORD_${role}=$(head -c 24 /dev/urandom | base64 | tr -d '/+=')"
done
