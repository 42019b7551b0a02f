#!/usr/bin/env bash
# Two on-policy rounds with a real vLLM server at 0.5B-class size, time per phase (generate, score, train) per round.
# From the repository root:
#   bash benchmarks/gpu/rounds_vllm.sh fetch     # development machine: vLLM and its dependencies as wheels in .whl-vllm/
#   bash benchmarks/gpu/rounds_vllm.sh run       # GPU machine: the two rounds with engine=vllm, logs under $OUT
#   bash benchmarks/gpu/rounds_vllm.sh dry-run   # any machine, CPU: the same prefpack part with the transformers
#                                                # engine and a tiny Qwen2 (checks the script, not vLLM)
# The model is MODEL (a Qwen2.5-0.5B-Instruct folder) when given, else its config with random weights (no weights
# offline), with the Qwen2.5 tokenizer carried in .gpu/qwen2.5 (cp -r ../shared/tokenizers/qwen2.5 .gpu/). vLLM pins
# its own torch and transformers, so it runs from its own environment: VLLM_PYTHON (a python with vllm), else a venv
# made in /tmp/vllm-env from .whl-vllm/ (VLLM_SPEC, default vllm==0.33.0). prefpack runs with PYTHON (and the wheels of
# benchmarks/gpu/fetch_wheels.sh in .whl/, as session.sh installs them). Prompts: the quickstart's reviews as chat
# messages; reward: how close the answer is to the true label (the README's example).
set -uo pipefail
what=${1:-run}
py=${PYTHON:-python3}
OUT=${OUT:-gpu-out}
VLLM_SPEC=${VLLM_SPEC:-vllm==0.33.0}
PROMPTS=${PROMPTS:-64} K=${K:-8} MAX_NEW=${MAX_NEW:-128} STEPS=${STEPS:-10}
mkdir -p "$OUT"
if [ "$what" = fetch ]; then
  mkdir -p .whl-vllm
  "$py" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl-vllm "$VLLM_SPEC" || exit 1
  du -sh .whl-vllm
  exit 0
fi
if [ -z "${NO_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then  # prefpack's pins, as session.sh installs them
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
work=${WORK:-/tmp/rounds-vllm}
rm -rf "$work" && mkdir -p "$work"
if [ "$what" = run ]; then
  engine=(rounds.engine=vllm)
  vpy=${VLLM_PYTHON:-}
  if [ -z "$vpy" ] && ls .whl-vllm/*.whl >/dev/null 2>&1; then
    "$py" -m venv /tmp/vllm-env && /tmp/vllm-env/bin/python -m pip install -q --no-index --find-links .whl-vllm \
      "$VLLM_SPEC" || { echo "rounds_vllm.sh: cannot install $VLLM_SPEC from .whl-vllm/" >&2; exit 1; }
    vpy=/tmp/vllm-env/bin/python
  fi
  if [ -z "$vpy" ] || ! "$vpy" -c "import vllm" 2>/dev/null; then
    echo "rounds_vllm.sh: no vLLM environment: set VLLM_PYTHON to a python with vllm, or run 'fetch' and carry .whl-vllm/" >&2
    exit 1
  fi
  "$vpy" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" | tee "$OUT/vllm_env.txt"
  engine+=("rounds.vllm_command=$vpy -m vllm.entrypoints.openai.api_server --model {model} --host {host} --port {port} --gpu-memory-utilization ${VLLM_MEMORY:-0.5} --max-model-len 1024 --seed 0")
  size=qwen0.5b
elif [ "$what" = dry-run ]; then
  engine=(rounds.engine=transformers train.device=cpu)
  size=tiny PROMPTS=${DRY_PROMPTS:-8} K=4 MAX_NEW=4 STEPS=2
else
  echo "usage: rounds_vllm.sh fetch|run|dry-run" >&2
  exit 2
fi
"$py" - "$work" "$size" "$PROMPTS" <<'PY' || exit 1
import json, os, sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from prefpack.quickstart import make_pairs

work, size, prompts = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
model_dir = os.environ.get("MODEL")
if not model_dir:
    tok_dir = Path(".gpu/qwen2.5") if Path(".gpu/qwen2.5/tokenizer.json").is_file() else Path("../shared/tokenizers/qwen2.5")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    dims = (dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2) if size == "qwen0.5b" else
            dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    config = Qwen2Config(vocab_size=len(tok), max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16",
                         **dims)  # Qwen2.5-0.5B-Instruct (size qwen0.5b) but vocab = the tokenizer's 151,665
                         # (not 151,936: random weights would sample the padding ids, which no tokenizer holds)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16 if size == "qwen0.5b" else torch.float32)
    model_dir = work / "init"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    print(f"model: {model_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, random weights)")
with open(work / "prompts.jsonl", "w", encoding="utf-8") as fh:
    for r in make_pairs(prompts, 1):
        fh.write(json.dumps({"messages": [{"role": "user", "content": r["prompt"]}], "label": r["chosen"].strip()})
                 + "\n")
(work / "model_dir").write_text(str(model_dir))
(work / "reward.py").write_text('''import difflib


def reward(prompt, completion, row):
    return difflib.SequenceMatcher(None, completion.strip().lower(), row["label"]).ratio()
''')
PY
start=$(date +%s)
"$py" -m prefpack train "model.name_or_path=$(cat "$work/model_dir")" "run.output_dir=$work/run" run.report_to=none \
  run.plot=false train.global_batch_pairs=16 optim.lr=1e-6 loss.beta=0.1 rounds.count=2 \
  "rounds.prompts=$work/prompts.jsonl" rounds.prompt_field=messages "rounds.samples_per_prompt=$K" \
  "rounds.max_new_tokens=$MAX_NEW" "rounds.reward_fn=$work/reward.py:reward" "rounds.steps_per_round=$STEPS" \
  rounds.pairs=best_vs_worst "${engine[@]}" --no-progress 2>&1 | tee "$OUT/rounds_$what.log"
status=${PIPESTATUS[0]}
echo "wall: $(( $(date +%s) - start )) s, exit $status" | tee -a "$OUT/rounds_$what.log"
"$py" - "$work/run" <<'PY' | tee "$OUT/rounds_${what}_phases.txt"
import json, sys
from pathlib import Path

run = Path(sys.argv[1])
print(f"{'round':>5} {'generate s':>10} {'gen tok/s':>10} {'score s':>8} {'train s':>8} {'reward mean':>12} {'pairs':>6}")
for folder in sorted((run / "rounds").glob("[0-9][0-9][0-9]")):
    p = json.loads((folder / "phases.json").read_text()) if (folder / "phases.json").is_file() else {}
    r = json.loads((folder / "round.json").read_text()) if (folder / "round.json").is_file() else {}
    g = p.get("generate", {})
    rate = g["tokens"] / g["seconds"] if g.get("seconds") else float("nan")
    print(f"{folder.name:>5} {g.get('seconds', float('nan')):>10.2f} {rate:>10.0f} "
          f"{p.get('score', {}).get('seconds', float('nan')):>8.2f} {p.get('train', {}).get('seconds', float('nan')):>8.2f} "
          f"{r.get('reward/mean', float('nan')):>12.4f} {r.get('pairs', 0):>6}")
PY
exit "$status"
