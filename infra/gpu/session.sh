#!/usr/bin/env bash
# The wire on a GPU in one device call: the prepared checks in order of what they decide, within
# the call's time. A lent GPU gives a session about 15 device-minutes and a call at most 10, so
# the steps that measure the wire come first and a step that could not finish in the time left
# is never started (it is named, for the next call):
#   transfer  infra/gpu/transfer-check.sh   pulls between two processes: ucx, then the shm channel
#                                            on device exports (CUDA IPC), against the device's copy
#   mesh      infra/gpu/mesh-check.sh       the whole mesh: TTFT through it against the engine alone
#   nixl      infra/gpu/transfer-check.sh --channels nixl   the nixl channel against NIXL's own
#                                            READ of device memory (needs the nixl archive: NIXL),
#                                            after the re-export probe's verdict line ("reexport: ...")
#   check     infra/gpu/check.sh            the engine alone (TTFT per plan, exactness, graphs)
#   CARRY=build/gpu-mesh.tar.xz bash infra/gpu/session.sh [--steps transfer,mesh,nixl,check] [--budget S] [--tiny]
# Each step's output is in $OUT/STEP.log (the last lines also here) and its JSON in $OUT
# (gpu-transfer.json, mesh-check.json, gpu-transfer-nixl.json, check.json). --budget: seconds this call may take (default
# 570, inside the 600 s a call may run); a step is started only if its own limit (the timeout
# its script runs under) fits in what is left. --tiny: each step's CPU path, with no budget (CI).
# Exit status: 0 when every step asked for ran and passed; 1 otherwise (skipped steps included).
set -uo pipefail
cd "$(dirname "$0")/../.."

steps=transfer,mesh,check
budget=570
tiny=0
while (($#)); do
  case "$1" in
    --steps) steps=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --tiny) tiny=1; shift ;;
    *) echo "usage: $0 [--steps transfer,mesh,nixl,check] [--budget SECONDS] [--tiny]" >&2; exit 2 ;;
  esac
done
if ! [[ $budget =~ ^[0-9]+$ ]]; then
  echo "--budget: a whole number of seconds, not '$budget'" >&2
  exit 2
fi
for name in ${steps//,/ }; do
  case "$name" in
    transfer | mesh | nixl | check) ;;
    *) echo "--steps: unknown step '$name' (transfer, mesh, nixl, check)" >&2; exit 2 ;;
  esac
done
out=${OUT:-$(mktemp -d)}
export OUT=$out
start=$SECONDS
status=0

# step NAME LIMIT COMMAND...: run COMMAND when LIMIT seconds fit in the budget left.
step() {
  local name=$1 limit=$2 left rc t0
  shift 2
  left=$((budget - (SECONDS - start)))
  if ((tiny == 0 && left < limit)); then
    echo "SKIPPED $name: its limit is ${limit}s and ${left}s of the budget are left (run it in a call of its own)"
    status=1
    return
  fi
  t0=$SECONDS
  "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0))s ($out/$name.log)"
  tail -n 20 "$out/$name.log"
  ((rc == 0)) || status=1
}

for name in ${steps//,/ }; do
  case "$name" in
    transfer)
      if ((tiny)); then step transfer 175 bash infra/gpu/transfer-check.sh --dry-run --sizes 4096,65536 --repeats 1
      else step transfer 175 bash infra/gpu/transfer-check.sh; fi ;;
    mesh)
      if ((tiny)); then step mesh 295 bash infra/gpu/mesh-check.sh --tiny --json "$out/mesh-check.json"
      else step mesh 295 bash infra/gpu/mesh-check.sh --json "$out/mesh-check.json"; fi ;;
    nixl)
      if ((tiny)); then step nixl 175 bash infra/gpu/transfer-check.sh --dry-run --channels nixl --sizes 4096,65536 --repeats 1 --json "$out/gpu-transfer-nixl.json"
      else step nixl 175 bash infra/gpu/transfer-check.sh --channels nixl --json "$out/gpu-transfer-nixl.json"; fi ;;
    check)
      if ((tiny)); then step check 295 bash infra/gpu/check.sh --tiny --out "$out/check.json"
      else step check 295 bash infra/gpu/check.sh --out "$out/check.json"; fi ;;
  esac
done
echo "session: $((SECONDS - start))s, exit $status; outputs in $out"
exit $status
