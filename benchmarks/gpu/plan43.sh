#!/usr/bin/env bash
# Issue 43 in ONE device call that fits a 15-minute GPU lease (about 8 minutes of wall on an H100), in priority
# order, each step under its own `timeout` and a shared budget (BUDGET seconds), a failed or timed-out step never
# stopping the next. Logs, steps.tsv and summary.json under $OUT.
#
# Before the GPU session, on the development machine, from the repository root (both folders are git-ignored):
#   PYTHON=/path/to/venv/bin/python bash benchmarks/gpu/fetch_wheels.sh   # .whl/: ~26 MiB (bitsandbytes slimmed)
#   mkdir -p .gpu && cp -r ../shared/tokenizers/qwen2.5 .gpu/              # .gpu/: ~18 MiB
#   DRY=1 PYTHON=/path/to/venv/bin/python NO_WHEELS=1 SITE=/dir/with/trl bash benchmarks/gpu/plan43.sh
# The GPU session's call (the device tool):
#   run(command="bash benchmarks/gpu/plan43.sh", carry=[".whl", ".gpu"], timeout_s=570)
# ONLY="compare,qlora" reruns a subset (names below); BUDGET=300 shortens the whole.
#
# Steps (GPU values; DRY=1: CPU, tiny presets, 2 steps, about 10 minutes on 2 busy cores, QLoRA the longest):
#   tests   every CUDA-gated test: tests/test_gpu.py, tests/test_gpu_paths.py, tests/test_recurrent_cuda.py
#           (PREFPACK_TEST_CUDA=1; the recurrent kernels skip with their reason where their packages are absent)
#   compare compare_trl.py at 0.7b, Qwen2.5 vocabulary, 32 pairs a step, 21 steps (20 timed) against TRL 1.16's
#           DPOTrainer (defaults): mean and median tokens/s, peak allocated, MFU at both
#   qlora   the same at 1.3b with --qlora 16 (4-bit NF4 base + LoRA r16 on every linear) against TRL's QLoRA DPO
#           (peft + BitsAndBytesConfig), 11 steps; the largest preset a 2-minute slot allows
#   reward  reward_model.py on CUDA: prefpack's reward objective against TRL's RewardTrainer (hh pairs; ranked x8)
#           and packed scoring against padded, 12 layers x 1024 (GPT-NeoX vocabulary)
#   grpo    grpo_step.py (issue 53): one GRPO loss step at k = 8, Qwen2.5-0.5B's shape from a config (vocabulary
#           151,936), bf16 autocast, 8 prompts of 256-512 tokens x 8 completions of 64-256, one prompt's 8 samples a
#           micro-batch (TRL: per-device batch 8, gradient accumulation 8): prefpack prompts once / each sample alone /
#           TRL 1.16 GRPOTrainer._compute_loss + backward on the same samples; tokens/s, peak allocated, the
#           first-step losses (must agree). Alone: ONLY=grpo BUDGET=220 bash benchmarks/gpu/plan43.sh
#   vision  bench_vision.py --device cuda, tiny Qwen2-VL against TRL (only with time left; the toy's speed says little)
#   compare13  compare at 1.3b, 21 steps (only with time left)
#   vLLM rounds: skipped here (vLLM needs its own environment on the machine: benchmarks/gpu/rounds_vllm.sh)
set -uo pipefail
py=${PYTHON:-python3}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
: > "$OUT/steps.tsv"
if [ -n "${DRY:-}" ]; then
  DEV=cpu DTYPE=float32 PRESET=cpu QPRESET=cpu CASE=neox PAIRS=4 STEPS=2 QSTEPS=2 BUDGET=${BUDGET:-900}
  REWARD_ARGS="--layers 2 --hidden 128 --pairs 16 --pair-batch 4 --prompts 2 --score-prompts 2 --steps 2"
  VISION_ARGS="--pairs 4 --batch-pairs 2 --steps 2" VISION_LIMIT=180 QLIMIT=420
  GRPO_ARGS="--model-size tiny --k 8 --prompts 2 --prompt-len 32,64 --completion-len 16,48 --micro-batch prompt --warmup 1 --steps 2"
else
  DEV=cuda DTYPE=bfloat16 PRESET=0.7b QPRESET=${QPRESET:-1.3b} CASE=qwen PAIRS=32 STEPS=${STEPS:-21}
  QSTEPS=${QSTEPS:-11} BUDGET=${BUDGET:-470}
  REWARD_ARGS="--layers 12 --hidden 1024 --pairs 256 --pair-batch 32 --prompts 16 --prompt-batch 2 --score-prompts 64 --steps 6 --threads 4"
  VISION_ARGS="--threads 4" VISION_LIMIT=90 QLIMIT=150
  GRPO_ARGS="--model-size 0.5b --k 8 --prompts 8 --micro-batch prompt --warmup 2 --steps 5 --threads 4"
fi
SITE=${SITE:-/tmp/site}
if [ -z "${NO_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1 && [ ! -f "$SITE/.plan43" ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    > "$OUT/install.log" 2>&1 && touch "$SITE/.plan43" || echo "wheel install failed: $OUT/install.log"
fi
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
QWEN=none
[ -f .gpu/qwen2.5/tokenizer.json ] && QWEN=.gpu/qwen2.5
du -sh .whl .gpu 2>/dev/null | tee "$OUT/carry.txt"
"$py" - <<'PY' 2>&1 | tee "$OUT/env.txt"
import importlib, torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")
for name in ("trl", "peft", "bitsandbytes", "accelerate", "datasets", "fla", "mamba_ssm", "causal_conv1d", "vllm"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:  # noqa: BLE001 - what is missing is the answer here
        print(name, "MISSING:", type(exc).__name__, str(exc).splitlines()[0][:120] if str(exc) else "")
PY
start=$(date +%s)

# step NAME SECONDS [MIN_LEFT] -- CMD...: run CMD under min(SECONDS, budget left); skipped when less than MIN_LEFT
# (default 30) seconds are left or ONLY names other steps. Output in $OUT/NAME.log, a row in steps.tsv.
step() {
  local name=$1 want=$2 need=30
  shift 2
  if [ "$1" != -- ]; then need=$1; shift; fi
  shift
  local left=$((BUDGET - $(date +%s) + start))
  if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then return; fi
  if ((left < need)); then
    printf '%s\tskipped\t0\t%s\n' "$name" "$left" >> "$OUT/steps.tsv"
    echo "== $name: skipped, $left s of the budget left"
    return
  fi
  ((want > left)) && want=$left
  echo "== $name (limit $want s): $*"
  local t0=$(date +%s)
  timeout -k 15 "$want" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$want" >> "$OUT/steps.tsv"
  echo "   rc $rc after $(($(date +%s) - t0)) s; tail:"
  tail -n 4 "$OUT/$name.log" | cut -c1-300
}
compare=("$py" benchmarks/compare_trl.py --device "$DEV" --dtype "$DTYPE" --cases "$CASE" --qwen-tokenizer "$QWEN"
         --batch-pairs "$PAIRS" --runs prefpack,trl)  # compare_trl.py with the plan's common arguments

step tests 150 -- env PREFPACK_TEST_CUDA=1 "$py" -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py \
  tests/test_gpu_paths.py tests/test_recurrent_cuda.py
step compare 280 -- "${compare[@]}" --preset "$PRESET" --steps "$STEPS"
step qlora "$QLIMIT" -- "${compare[@]}" --preset "$QPRESET" --steps "$QSTEPS" --qlora 16
# shellcheck disable=SC2086
step reward 120 -- "$py" benchmarks/reward_model.py --device "$DEV" $REWARD_ARGS
# shellcheck disable=SC2086
step grpo 200 60 -- "$py" benchmarks/grpo_step.py --device "$DEV" $GRPO_ARGS --json "$OUT/grpo.json"
# shellcheck disable=SC2086
step vision "$VISION_LIMIT" 60 -- "$py" benchmarks/bench_vision.py --device "$DEV" --same-start --model qwen2_vl $VISION_ARGS
[ -n "${DRY:-}" ] || step compare13 240 200 -- "${compare[@]}" --preset 1.3b --steps "$STEPS"
printf 'vllm\tskipped\t0\tvLLM needs its own environment on the machine (benchmarks/gpu/rounds_vllm.sh)\n' \
  >> "$OUT/steps.tsv"
"$py" benchmarks/gpu/plan43_summary.py "$OUT" | tee "$OUT/summary.json"
