#!/usr/bin/env bash
# The real tier's profile on one GPU, timed: `droidmesh profile --search fidelity` of a
# SmolLM2-135M pair on 64 train + 200 test doc_qa rows, announced, then run; one JSON (--out FILE).
# The real weights cannot travel with the tree (98 MB packed), so the pair is random weights of
# the real shape and tokenizer (shared/tools/bench/gpu_profile.py): the time is the real pair's,
# the choice means nothing.
#   here, once:  bash infra/gpu/profile-check.sh --prepare   (the real base's tokenizer files,
#                ~3.5 MB, into .gpu/smollm2: carry that path; `droidmesh zoo build --tier real` first)
#   there:       bash infra/gpu/profile-check.sh [--out FILE] [--n-train N] [--n-test N] [--dtype D]
#   on the CPU:  bash infra/gpu/profile-check.sh --tiny [--like DIR]   (8 layers, a few rows: CI)
# Sequence (steps 1-3: infra/gpu/prepare.sh):
#   1. Python: $PYTHON, else the repo's .venv, else python3 (torch is never installed);
#   2. with $WHEELS (carried wheels for the machine's Python: msgspec, structlog, xxhash,
#      rapidfuzz, rouge-score, nltk, absl-py) install them offline into a scratch folder;
#   3. name every missing module and stop (exit 2), rather than a traceback;
#   4. python -m droidmesh.shared.tools.bench.gpu_profile under a 580 s limit.
set -euo pipefail
cd "$(dirname "$0")/../.."
LIKE=.gpu/smollm2

if [[ "${1:-}" == "--prepare" ]]; then
  base="${DROIDMESH_ZOO_DIR:-$HOME/.cache/droidmesh/zoo}/real/base"
  [[ -f "$base/config.json" ]] || { echo "no real tier at $base: run droidmesh zoo build --tier real" >&2; exit 2; }
  mkdir -p "$LIKE"
  for f in tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json; do
    if [[ -f "$base/$f" ]]; then cp "$base/$f" "$LIKE/"; fi
  done
  echo "$LIKE: $(du -sh "$LIKE" | cut -f1); carry it (run's carry: [\"$LIKE\"])"
  exit 0
fi

source infra/gpu/prepare.sh
require "torch=the machine's CUDA build (never installed by this script)" "transformers=transformers 5.x" numpy=numpy \
  msgspec=msgspec structlog=structlog tqdm=tqdm xxhash=xxhash rapidfuzz=rapidfuzz rouge_score=rouge-score \
  nltk=nltk absl=absl-py

require_project
args=("$@")
if [[ " $* " != *" --like "* ]]; then
  args+=(--like "$LIKE")
fi
exec timeout 580 "$py" -m droidmesh.shared.tools.bench.gpu_profile "${args[@]}"
