#!/usr/bin/env bash
# One device call that measures what only a GPU shows, logs under $OUT. From the repository root, with .whl
# carried (benchmarks/gpu/fetch_wheels.sh):
#   bash benchmarks/gpu/session.sh [tests|compare|all|float32|profile|sharing|recurrent|vision] [PRESETS]
# tests:   the CUDA tests (the chunked head in bfloat16; torch's varlen kernel against the reference in bfloat16, prompt-shared rows with gathered
#          keys included; training with prompts laid out once on varlen; budgets) and the CPU-exact
#          precision/varlen/varlen-sharing tests;
# float32: prefpack and TRL losses on CUDA in float32, every step (first preset);
# profile: benchmarks/gpu/profile_train.py (torch.profiler over steady steps; first preset);
# compare: benchmarks/compare_trl.py against TRL 1.16 in bf16 mixed precision, 32 hh pairs per step, the
#          GPU presets (default "0.7b 1.3b"), vocabulary 151,936; about 3-5 minutes per preset.
# sharing: prefpack alone on varlen, the compare run twice per preset, data.prefix_sharing=true then false (same
#          pairs and steps; tokens/s counts every sequence's prompt, so the ratio of the two is the speed-up);
#          logs sharing_<preset>_<true|false>.log; about 2 minutes per run.
# recurrent: tests/test_recurrent_cuda.py (tests and all run it too): flash-linear-attention, causal-conv1d and mamba_ssm
#          on packed Qwen3.5 / Nemotron-H rows against each sequence alone; skipped, with the reason, where those
#          packages are not installed (pip install flash-linear-attention causal-conv1d mamba-ssm); under a minute.
# vision:  benchmarks/bench_vision.py on CUDA (tiny Qwen2-VL and LLaVA against TRL 1.16: losses by step, encodings
#          per image; the toy's speed says little) after tests/test_gpu_paths.py's image cases; about 2 minutes.
# grpo:    benchmarks/grpo_step.py on CUDA (issue 53): a GRPO loss step at k = 8 (0.5B Qwen2 shape, bf16 autocast,
#          8 prompts x 8 samples, one prompt a micro-batch), prompts once / each sample alone / TRL 1.16's
#          GRPOTrainer loss step on the same samples; GRPO_ARGS replaces the arguments; about 2-3 minutes.
set -uo pipefail
py=${PYTHON:-python3}
what=${1:-all}
presets=${2:-"0.7b 1.3b"}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if [ -z "${NO_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then  # NO_WHEELS=1: use what is installed
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
elif [ -d /tmp/site ]; then  # installed by an earlier call on this machine
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
"$py" - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")
from prefpack.model.attention.varlen import torch_varlen_kernel
print("varlen kernel (fn, enable_gqa, window_size):", torch_varlen_kernel())
PY
QWEN=${QWEN:-none}
[ -f .gpu/qwen2.5/tokenizer.json ] && QWEN=.gpu/qwen2.5  # carried: cp -r ../shared/tokenizers/qwen2.5 .gpu/
if [ "$what" = tests ] || [ "$what" = all ]; then
  PREFPACK_TEST_CUDA=1 timeout "${TESTS_TIMEOUT:-240}" "$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py \
    tests/test_gpu_paths.py tests/test_varlen.py tests/test_varlen_shared.py tests/test_precision.py tests/test_budgets.py tests/test_logprobs.py 2>&1 \
    | tee "$OUT/tests.log"
fi
if [ "$what" = tests ] || [ "$what" = all ] || [ "$what" = recurrent ]; then  # the recurrent layers' CUDA kernels
  PREFPACK_TEST_CUDA=1 timeout "${TESTS_TIMEOUT:-240}" "$py" -m pytest -q -rs -p no:cacheprovider \
    tests/test_recurrent_cuda.py 2>&1 | tee "$OUT/recurrent.log"
fi
if [ "$what" = compare ] || [ "$what" = all ]; then
  for preset in $presets; do
    timeout "${COMPARE_TIMEOUT:-400}" "$py" benchmarks/compare_trl.py --device cuda --dtype bfloat16 \
      --preset "$preset" --cases qwen --qwen-tokenizer "$QWEN" --batch-pairs 32 --steps "${STEPS:-4}" \
      --runs "${RUNS:-prefpack,trl,trl_no_gc}" ${EXTRA:-} 2>&1 | tee "$OUT/compare_$preset.log"
  done
fi
if [ "$what" = float32 ]; then  # losses on CUDA in float32 against TRL, every step
  timeout "${COMPARE_TIMEOUT:-300}" "$py" benchmarks/compare_trl.py --device cuda --dtype float32 \
    --preset "${presets%% *}" --cases qwen --qwen-tokenizer "$QWEN" --batch-pairs 32 --steps "${STEPS:-4}" \
    --runs prefpack,trl_no_gc ${EXTRA:-} 2>&1 | tee "$OUT/float32.log"
fi
if [ "$what" = profile ]; then
  timeout "${PROFILE_TIMEOUT:-200}" "$py" benchmarks/gpu/profile_train.py --preset "${presets%% *}" \
    --qwen-tokenizer "$QWEN" ${EXTRA:-} 2>&1 | tee "$OUT/profile.log"
fi
if [ "$what" = sharing ]; then  # prompts laid out once vs not, on varlen; EXTRA adds overrides to both
  for preset in $presets; do
    for share in true false; do
      timeout "${COMPARE_TIMEOUT:-400}" "$py" benchmarks/compare_trl.py --device cuda --dtype bfloat16 \
        --preset "$preset" --cases qwen --qwen-tokenizer "$QWEN" --batch-pairs 32 --steps "${STEPS:-4}" \
        --runs prefpack --override "data.prefix_sharing=$share" --override model.attn_implementation=varlen \
        ${EXTRA:-} 2>&1 | tee "$OUT/sharing_${preset}_${share}.log"
    done
  done
fi
if [ "$what" = vision ]; then  # image pairs on CUDA: the CUDA image tests, then the TRL comparison per family
  PREFPACK_TEST_CUDA=1 timeout "${TESTS_TIMEOUT:-240}" "$py" -m pytest -q -p no:cacheprovider tests/test_gpu_paths.py \
    -k images 2>&1 | tee "$OUT/vision_tests.log"
  for model in qwen2_vl llava; do
    timeout "${COMPARE_TIMEOUT:-300}" "$py" benchmarks/bench_vision.py --device cuda --same-start --model "$model" \
      ${EXTRA:-} 2>&1 | tee "$OUT/vision_$model.log"
  done
fi
if [ "$what" = grpo ]; then
  # shellcheck disable=SC2086
  timeout "${GRPO_TIMEOUT:-300}" "$py" benchmarks/grpo_step.py --device cuda \
    ${GRPO_ARGS:---model-size 0.5b --k 8 --prompts 8 --micro-batch prompt --warmup 2 --steps 5 --threads 4} \
    --json "$OUT/grpo.json" 2>&1 | tee "$OUT/grpo.log"
fi
