#!/usr/bin/env bash
# What CI (CPU only) cannot check, on one CUDA GPU, in about four minutes:
#
#   1. the NVML collector's tests (the real-GPU one runs) and one scrape, idle and busy;
#   2. `dpserve finetune` at world size 1 (NCCL) under ddp, zero1, fsdp (+ resume),
#      activation checkpointing, LoRA under ddp (+ merge) and fsdp, on build/tiny-llama:
#      the loss falls, the checkpoint validates as a deploy validates it;
#   3. the dtypes a step really computes in per strategy, and what autograd saves beside
#      `--plan`'s GPU estimate (benchmarks/gpu/check.py precision);
#   4. ddp against fsdp on a ~270M random-weight Llama: step time, tokens/s, peak memory.
#
#   benchmarks/gpu/check.sh OUTDIR          # results.jsonl, log.txt, gpu_metrics_*.txt, runs.tgz
#   GPU_CHECK_QUICK=1 benchmarks/gpu/check.sh OUTDIR   # a short dry run (works on CPU)
#   GPU_CHECK_RUNS="ddp lora-ddp precision" benchmarks/gpu/check.sh OUTDIR  # some of 2.-3.
#
# Every check prints a `RESULT {json}` line; OUTDIR/results.jsonl collects them as they
# come, so a run cut short still reports what it finished.
set -u
OUT=$(realpath -m "${1:?usage: benchmarks/gpu/check.sh OUTDIR}")
mkdir -p "$OUT"
PY=${PYTHON:-python3}
QUICK=${GPU_CHECK_QUICK:-0}
WORK=${GPU_CHECK_WORK:-/tmp/gpu-check}
TINY=$PWD/build/tiny-llama
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
rm -rf "$WORK" && mkdir -p "$WORK/logs" "$WORK/runs"
exec > >(tee -a "$OUT/log.txt") 2>&1

if [ "$QUICK" = 1 ]; then STEPS=4; BIG_STEPS=2; else STEPS=40; BIG_STEPS=20; fi
# Each phase is cut off so that the whole script ends within GPU_CHECK_BUDGET seconds
# (a hung NCCL call must not eat a lease); bench runs get what is left.
BUDGET=${GPU_CHECK_BUDGET:-400}
left() { echo $((BUDGET - SECONDS)); }

results() {  # the RESULT lines of every log so far, once each
  grep -h '^RESULT ' "$WORK"/logs/*.log 2>/dev/null | sed 's/^RESULT //' > "$OUT/results.jsonl"
}
finish() {
  results
  tar -czf "$OUT/runs.tgz" -C "$WORK" --exclude='*.safetensors' --exclude='*.pt' \
    --exclude='dcp' --exclude='*.png' logs runs 2>/dev/null
  echo "== $(wc -l < "$OUT/results.jsonl") results; failed: $(grep -c '"ok": false' "$OUT/results.jsonl")"
  grep '"ok": false' "$OUT/results.jsonl" | cut -c1-600
}
trap finish EXIT

ok_json() {  # name ok [text]: a RESULT line from the shell
  printf 'RESULT {"check": "%s", "ok": %s, "note": "%s"}\n' "$1" "$2" "${3:-}"
}

echo "== environment"
set -x
nvidia-smi
$PY -c 'import torch, peft, transformers; print(torch.__version__, peft.__version__, transformers.__version__, "cuda", torch.cuda.is_available(), torch.version.cuda, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)'
set +x

# `dpserve finetune` when the CLI imports (it imports the serving stack first), else the
# same launcher through benchmarks/gpu/check.py.
if $PY -c 'import dpserve.cli, dpserve.serve' 2>/dev/null; then
  FT=($PY -m dpserve finetune)
else
  echo "!! dpserve.cli does not import here (serving dependencies); python -m benchmarks.gpu.check finetune instead"
  $PY -c 'import dpserve.serve' 2>&1 | tail -1
  FT=($PY -m benchmarks.gpu.check finetune)
fi
echo "finetune command: ${FT[*]}"

echo "== 1. NVML collector"
{
  $PY -m pytest -q -rs -p no:cacheprovider --noconftest -c /dev/null --rootdir "$PWD" \
    tests/metrics/test_gpu.py
  code=$?
  skipped=$(grep -c 'SKIPPED' "$WORK/logs/nvml.log")
  [ $code = 0 ] && [ "$skipped" = 0 ] && ok=true || ok=false
  ok_json nvml_tests $ok "pytest exit $code, $skipped skipped"
  $PY -m benchmarks.gpu.check nvml "$OUT/gpu_metrics_idle.txt"
} > "$WORK/logs/nvml.log" 2>&1
cat "$WORK/logs/nvml.log"

echo "== 2. dpserve finetune on build/tiny-llama, world size 1"
$PY -m benchmarks.gpu.check data "$WORK/data" --n 256 --words 12

ft() {  # NAME [flags]: one `dpserve finetune` run into runs/NAME, its output in logs/NAME.log
  local name=$1; shift
  local cmd=("${FT[@]}" --model "$TINY" --data "$WORK/data/train.jsonl"
             --eval-data "$WORK/data/eval.jsonl" --eval-every 20 --output "$WORK/runs/$name"
             --nproc-per-node 1 --threads-per-rank 2 --max-steps "$STEPS"
             --micro-batch-size 8 --max-seq-len 128 --lr 1e-3 --warmup-steps 2 --log-every 5
             --seed 3 "$@")
  echo "+ ${cmd[*]}"
  timeout 150 "${cmd[@]}"
  local code=$?
  echo "exit $code"
  return $code
}
check() {  # NAME [--lora]
  local name=$1; shift
  $PY -m benchmarks.gpu.check check "$WORK/runs/$name" --base "$TINY" --name "$name" "$@"
}
tiny_run() {  # NAME CHECK-FLAGS -- FINETUNE-FLAGS
  local name=$1 check_flags=(); shift
  while [ "$1" != "--" ]; do check_flags+=("$1"); shift; done; shift
  { ft "$name" "$@" && check "$name" "${check_flags[@]}" \
      || ok_json "run" false "$name: dpserve finetune failed"; } > "$WORK/logs/$name.log" 2>&1
}

fsdp_resumed() {  # fsdp stopped half-way and resumed from its sharded (DCP) state
  { ft fsdp --strategy fsdp --stop-after-steps $((STEPS / 2)) \
      && ft fsdp --strategy fsdp --resume && check fsdp \
      || ok_json run false "fsdp: dpserve finetune failed"
    grep -q "resumed from step-$(printf %06d $((STEPS / 2)))" "$WORK/logs/fsdp.log" \
      && ok_json fsdp_resume true || ok_json fsdp_resume false "no resumed-from line"
  } > "$WORK/logs/fsdp.log" 2>&1
}
precision() {  # the dtypes of a step and the activations against the plan, in one process
  local q=()
  [ "$QUICK" = 1 ] && q=(--quick --batch 2 --seq 64)
  { timeout 150 $PY -m benchmarks.gpu.check precision --model "$TINY" \
      --out "$WORK/runs/precision.json" "${q[@]}" \
      || ok_json precision false "exit $?"; } > "$WORK/logs/precision.log" 2>&1
}
PIDS=()
spawn() {  # in parallel on the GPU; one after the other in a dry run
  local key=$1
  [ "$1" = tiny_run ] && key=$2
  # GPU_CHECK_RUNS="ddp precision ...": only these (a rerun after a fix)
  [ -z "${GPU_CHECK_RUNS:-}" ] || [[ " $GPU_CHECK_RUNS " == *" $key "* ]] || return 0
  if [ "$QUICK" = 1 ]; then "$@"; else "$@" & PIDS+=($!); fi
}

T0=$SECONDS
spawn tiny_run ddp -- --strategy ddp
spawn tiny_run zero1 -- --strategy zero1
spawn tiny_run ddp-ac -- --strategy ddp --activation-checkpointing
spawn tiny_run fsdp-ac-zero2 -- --strategy fsdp --activation-checkpointing --no-reshard-after-forward
spawn tiny_run lora-ddp --lora -- --strategy ddp --lora-rank 8 --lr 3e-3 --merge-on-save
spawn tiny_run lora-fsdp-ac --lora -- --strategy fsdp --lora-rank 8 --lr 3e-3 --activation-checkpointing
spawn fsdp_resumed
spawn precision
[ "$QUICK" = 1 ] || sleep 20
$PY -m benchmarks.gpu.check nvml "$OUT/gpu_metrics_busy.txt" > "$WORK/logs/nvml-busy.log" 2>&1
# Not a bare `wait`: it would also wait for the `tee` of the log, forever.
[ ${#PIDS[@]} -gt 0 ] && wait "${PIDS[@]}"
echo "tiny runs and precision: $((SECONDS - T0))s"
for f in "$WORK"/logs/*.log; do
  echo "---- $(basename "$f")"
  grep -E '^(RESULT|finetune:|memory on|done in|step +(5|20|40)/|checkpoint |exit |Traceback|[A-Za-z]*Error)' "$f" | cut -c1-400
  grep -q 'Traceback\|exit [1-9]' "$f" && tail -n 25 "$f"
done
results

echo "== 4. ddp vs fsdp on a bigger random-weight Llama ($(left)s left)"
T0=$SECONDS
BIG=$WORK/big-llama
if [ "$QUICK" = 1 ]; then
  size=(--hidden 128 --intermediate 256 --layers 2 --heads 2 --vocab 1024); seq=128
else
  size=(--hidden 1024 --intermediate 2816 --layers 16 --heads 8 --vocab 32000); seq=1024
fi
{
  $PY -m benchmarks.gpu.check build-model "$BIG" "${size[@]}"
  $PY -m benchmarks.gpu.check data "$WORK/long" --n 256 --words $((seq * 2 / 3))
} > "$WORK/logs/big-build.log" 2>&1
cat "$WORK/logs/big-build.log"
for s in ddp fsdp; do
  bflags=(--model "$BIG" --data "$WORK/long/train.jsonl" --nproc-per-node 1
          --micro-batch-size 8 --max-seq-len $seq --strategy $s)
  {
    "${FT[@]}" --plan "${bflags[@]}"
    cmd=("${FT[@]}" "${bflags[@]}" --output "$WORK/runs/big-$s"
         --max-steps $BIG_STEPS --log-every 5 --warmup-steps 2 --lr 3e-4)
    echo "+ ${cmd[*]}"
    limit=$(( $(left) / 2 - 10 ))
    [ $s = fsdp ] && limit=$(( $(left) - 15 ))
    [ $limit -gt 20 ] || { echo "skipped: $(left)s left"; continue; }
    timeout $limit "${cmd[@]}"; echo "exit $?"
  } > "$WORK/logs/big-$s.log" 2>&1
  grep -E '^(\+ |finetune:|memory on|done in|step |exit |  (total|weights|activations|peak)|Traceback|[A-Za-z]*Error)' \
    "$WORK/logs/big-$s.log" | cut -c1-400
done
$PY -m benchmarks.gpu.check bench "$WORK/runs/big-ddp" "$WORK/runs/big-fsdp" \
  --logs "$WORK/logs/big-ddp.log" "$WORK/logs/big-fsdp.log" > "$WORK/logs/bench.log" 2>&1
cat "$WORK/logs/bench.log"
echo "bench: $((SECONDS - T0))s; total ${SECONDS}s"
