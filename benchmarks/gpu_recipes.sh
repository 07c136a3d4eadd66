#!/usr/bin/env bash
# Each named recipe at reduced depth on one H200 (the published per-layer shape, 4 layers; docs/recipes.md),
# measured next to the estimator's prediction: the data behind docs/evidence/recipes-h200.
#   bash benchmarks/gpu_recipes.sh [recipe ...]      # default: all six, about 8 minutes
# Per recipe one sweep into results/recipe_<name>/: no recompute and the guide's label for its family
# (DeepSeek-V3: its published full recompute instead of none, which does not fit one H200 with 32
# experts), then `python -m recipes estimate --compare` writes compare.txt beside it. Last, every recipe
# run here is packed into docs/evidence/recipes-h200.jsonl.gz (tools/evidence.py) and its table regenerated.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 WANDB_MODE=offline TRITON_CACHE_AUTOTUNING=1
if [ -z "${PY:-}" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
ARGS=${ARGS-"profile=none train.train_iters=4 measure.start_step=2"}
declare -A OPTIONS=(
  [llama3_8b]=none,selective/core_attn
  [llama3_70b]=none,selective/core_attn
  [qwen3_30b_a3b]=none,selective/moe_act
  [moonlight_16b_a3b]=none,selective/mla_up_proj-moe_act
  [deepseek_v3]=full,selective/mla_up_proj-moe_act
  [qwen3_next_80b_a3b]=none,selective/gdn_norm_out-moe_act
)
[ $# -eq 0 ] && set -- llama3_8b llama3_70b qwen3_30b_a3b moonlight_16b_a3b deepseek_v3 qwen3_next_80b_a3b
. benchmarks/triton_path.sh
mkdir -p results
for r in "$@"; do
  echo "== $(date -u +%FT%TZ) recipe=$r recompute=${OPTIONS[$r]}"
  pp=${PYTHONPATH:-}
  if [ "$r" = qwen3_next_80b_a3b ]; then pp=$(triton_path) || continue; fi  # GatedDeltaNet: Triton >= 3.7.1
  PYTHONPATH=$pp $PY train.py -m recipe=$r recompute=${OPTIONS[$r]} $ARGS hydra.sweep.dir=results/recipe_$r 2>&1 |
    grep -v "Warning\|warn(\|warnings.warn\|Evict LRU\|^ *\"\"\"" | grep "^\[ok\]\|^\[oom\]\|^\[failed\]\|error"
  $PY -m recipes estimate --compare results/recipe_$r 2>&1 | grep -v "Warning\|warn(" > results/recipe_$r/compare.txt
  cat results/recipe_$r/compare.txt
done
ran=(); for r in "$@"; do [ -d results/recipe_$r ] && ran+=(recipe_$r); done
[ ${#ran[@]} -gt 0 ] || exit 1
for d in "${ran[@]}"; do echo "== recipe=${d#recipe_} recompute=${OPTIONS[${d#recipe_}]}"; cat results/$d/compare.txt; echo; done \
  > results/recipes_compare.txt
$PY tools/evidence.py pack recipes-h200 results --sweeps "${ran[@]}" --compare results/recipes_compare.txt \
  --text results/recipes_compare.txt --date "$(date -u +%F)" \
  --gpu "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)" \
  --versions "$($PY -c "import sys, torch, megatron.core as m; print('Python', sys.version.split()[0], 'torch', torch.__version__, 'megatron-core', m.__version__)")" \
  --command "bash benchmarks/gpu_recipes.sh $*"
