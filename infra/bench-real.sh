#!/usr/bin/env bash
# The real tier's figures (docs/real-tier.md), written under zoo/real/: eval JSONs per pair, a
# profile with the profiler's defaults, TTFT at 1K/2K/4K tokens. About an hour on 2 CPU cores.
# STEPS=eval,profile,ttft,demo picks a subset.
set -euo pipefail
cd "$(dirname "$0")/.."
bash infra/bootstrap.sh
dm=".venv/bin/droidmesh"
steps=${STEPS:-eval,profile,ttft,demo}
out=zoo/real
mkdir -p "$out/eval" "$out/profiles"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
$dm zoo build --tier real

if [[ $steps == *eval* ]]; then
  # Groups of 3 and 6 layers every 3 layers; per-layer probes every 3 layers (each recomputes 29 of 30).
  while read -r sender receiver task; do
    $dm eval --sender "real/$sender" --receiver "real/$receiver" --task "$task" --split test --n 8 \
      --group-sizes 3,6 --group-stride 3 --layer-stride 3 --predictions \
      --json "$out/eval/$sender-to-$receiver.json"
  done <<'EOF'
base docqa doc_qa
base summ doc_summary
base code code_completion/real
summ docqa doc_qa
EOF
fi

if [[ $steps == *profile* ]]; then
  # The profiler's defaults, as a user runs it (it states its cost before it starts).
  /usr/bin/time -f "profile wall %e s" $dm profile --sender real/base --receiver real/docqa --task doc_qa \
    --json "$out/profiles/base-to-docqa.json" --plot "$out/profiles/base-to-docqa.png"
fi

if [[ $steps == *ttft* ]]; then
  $dm bench ttft --model "$($dm zoo list --json | .venv/bin/python -c \
    'import json,sys; print(next(m["path"] for m in json.load(sys.stdin)["models"] if m["name"] == "real/docqa"))')" \
    --contexts 1024,2048,4096 --repeats 3 --threads 1 --json "$out/eval/ttft.json" --plot "$out/eval/ttft.png"
fi

if [[ $steps == *demo* ]]; then
  $dm demo --tier real --rows 8 --json "$out/eval/demo.json"
fi
