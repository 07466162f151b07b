#!/usr/bin/env bash
# The session docs/deploying.md shows, run for real: serve the tiny model on 2 CPU
# replicas, fine-tune 20 steps, deploy, status, deploy a copy with one flipped byte.
# Prints the transcript (commands as `$ ...`, as the docs show them); paste it there.
#   bash scripts/docs_deploy_session.sh [WORKDIR]     (~2 min here; needs `make model`)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-$(mktemp -d)}
mkdir -p "$WORK" && cd "$WORK"
ln -sfn "$ROOT/build" build && ln -sfn "$ROOT/dpserve" dpserve
export PATH="$ROOT/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PORT=${PORT:-8000}
show() { printf '$ %s\n' "$*"; "$@" 2>&1; }

dpserve serve --model build/tiny-llama --replicas 2 --port "$PORT" --checkpoint-root runs \
    -- --enforce-eager --dtype float32 --max-model-len 512 > serve.log 2>&1 &
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
printf '$ %s\n    %s\n...\n' \
    "dpserve finetune --model build/tiny-llama --data dpserve/demo_data/train.jsonl \\" \
    "--output runs/deploy-ft --max-steps 20 --save-every 10 --nproc-per-node 2"
dpserve finetune --model build/tiny-llama --data dpserve/demo_data/train.jsonl \
    --output runs/deploy-ft --max-steps 20 --save-every 10 --nproc-per-node 2 2>&1 | tail -n 2
until grep -q "2/2 replicas ready after" serve.log; do
    kill -0 $SERVE 2>/dev/null || { cat serve.log; exit 1; }
    sleep 1
done
show dpserve deploy runs/deploy-ft/step-000020 --router "http://127.0.0.1:$PORT"
show dpserve status --router "http://127.0.0.1:$PORT"
mkdir -p runs/copy && cp -r runs/deploy-ft/step-000010 runs/copy/
python - <<'PY'
from pathlib import Path
p = Path("runs/copy/step-000010/model.safetensors"); b = bytearray(p.read_bytes()); b[-5] ^= 1
p.write_bytes(bytes(b))
PY
show dpserve deploy runs/copy/step-000010 --router "http://127.0.0.1:$PORT" || true
