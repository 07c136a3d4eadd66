#!/usr/bin/env bash
# The planner on this GPU, end to end (recipes/analyze/frontier.py). After `make install`, on an H100 or H200:
#   bash benchmarks/gpu_planner.sh                                   # calibrate + six questions
#   QUESTIONS="mla_long dense_short" bash benchmarks/gpu_planner.sh  # a subset (names below)
#   CALIBRATE=0 PROFILE=results/planner/gpu.yaml QUESTIONS=moe_long bash benchmarks/gpu_planner.sh  # reuse a profile
# 1. `python -m recipes calibrate --out results/planner/gpu.yaml` (under 2 minutes): the profile every plan uses.
# 2. For each question (model, size, budget GiB): `python -m recipes plan` prints the frontier of predicted peak
#    against step time over recompute x offload x micro-batch size and writes the top three's configs, plan.json
#    and plan.png under results/planner/<question>/; the one sweep line it prints runs exactly those three, each
#    capped at the budget (a plan the allocator cannot fit stops as oom), STEPS steps each; then
#    `python -m recipes advise DIR` says whether the measured order matched and which prediction missed by how much.
# Budgets fit an 80 GB H100 (77 GiB for the allocator). Each point is a fresh process: about 20 s to start, then
# its steps (h200_long: 7-8 s a step on an H100; h200: about 0.3 s). With STEPS=5 a long question is about 3
# minutes of GPU time, a short one about 1.5; calibrate about 1.
# Questions (what the spec profile predicts on an H100 wins): dense_long (standard_attn h200_long 60: recompute
# alone, selective/mlp at micro-batch 1), dense_long_offload (the same at 58: selective/mlp with attn_norm offload),
# mla_long (mla h200_long 70: the question whose offload pick ran out of memory), moe_long (moe h200_long 75:
# full/block), gdn_long (gdn h200_long 60: full), dense_short (standard_attn h200 30: micro-batch 4, no recompute),
# moe_short (moe h200 40: micro-batch 4). gdn_long needs Triton >= 3.7.1 on Hopper (fla issue 640): the installed
# one, else .triton/ from benchmarks/pack_triton.sh (benchmarks/triton_path.sh).
# 3. OVER=1: the points just past their budget (OVERS below: "over" by 0.5-0.7 GiB, and one "tight"), each run capped
#    at its budget: `python -m recipes estimate --budget-gib B` gives the verdict, train.py must end as oom (exit 3).
# Settings (environment): PY, QUESTIONS, STEPS (5), CALIBRATE (1), PROFILE (the profile plans use; default the
# calibrated one), EXTRA (overrides for every plan and point), OVER (0), OUT (results/planner).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
export TRITON_CACHE_AUTOTUNING=1  # fla's autotuned GDN kernels: tune once per machine, not per point
. benchmarks/triton_path.sh  # triton_path: a PYTHONPATH with Triton >= 3.7.1 for gdn_long
if [ -z "${PY:-}" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
OUT=${OUT:-results/planner}
QUESTIONS=${QUESTIONS:-dense_long dense_long_offload mla_long moe_long gdn_long dense_short moe_short}
STEPS=${STEPS:-5}
PROFILE=${PROFILE:-$OUT/gpu.yaml}
ARGS="profile=none measure.module_times=false train.train_iters=$STEPS measure.start_step=3 ${EXTRA:-}"
mkdir -p "$OUT"
stamp() { echo "== $(date -u +%FT%TZ) $*"; }
quiet() { grep -v "Warning\|warn(\|warnings.warn\|cpp_extension\|Activation Offload Summary\|^Rank\|^Total\|^=\+$\|^-\+$"; }

question() {
  case $1 in
    dense_long) echo "model=standard_attn size=h200_long 60";;
    dense_long_offload) echo "model=standard_attn size=h200_long 58";;
    mla_long) echo "model=mla size=h200_long 70";;
    moe_long) echo "model=moe size=h200_long 75";;
    gdn_long) echo "model=gdn size=h200_long 60";;
    dense_short) echo "model=standard_attn size=h200 30";;
    moe_short) echo "model=moe size=h200 40";;
    *) echo "unknown question $1" >&2; return 1;;
  esac
}

if [ "${CALIBRATE:-1}" = 1 ]; then
  stamp calibrate
  $PY -m recipes calibrate --out "$PROFILE" 2>&1 | quiet || exit 1
fi
[ -f "$PROFILE" ] || { echo "no profile at $PROFILE: run with CALIBRATE=1 or set PROFILE" >&2; exit 1; }

for q in $QUESTIONS; do
  spec=$(question "$q") || exit 1
  set -- $spec
  model=$1 size=$2 budget=$3
  dir="$OUT/$q"
  rm -rf "$dir"
  pythonpath=${PYTHONPATH:-}
  if [ "$model" = model=gdn ]; then pythonpath=$(triton_path) || continue; fi
  stamp "plan $q: $model $size, budget $budget GiB"
  PYTHONPATH=$pythonpath $PY -m recipes plan --budget-gib "$budget" --dir "$dir" $model $size \
    cluster.gpu="$PROFILE" $ARGS 2>&1 | quiet \
    | tee "$dir.plan.txt"
  line=$(grep -m1 "python train.py -m --config-dir" "$dir.plan.txt" | sed 's/^ *//; s/^python /'"${PY//\//\\/}"' /')
  if [ -z "$line" ]; then echo "($q: nothing fits, no sweep)"; continue; fi
  stamp "confirm $q"
  PYTHONPATH=$pythonpath bash -c "$line" 2>&1 | quiet | grep -E "^\[point|oom|refused|error|fix:|ms/step|GiB" | tail -30
  stamp "advise $q"
  PYTHONPATH=$pythonpath $PY -m recipes advise "$dir" --budget-gib "$budget" 2>&1 | quiet | tee "$dir.advise.txt" | tail -20
done
# name, budget GiB, overrides: the nearest points past a budget, for dense, MoE and an offload plan
OVERS=(
  "dense_mb4_over 25 model=standard_attn size=h200 train.micro_batch_size=4"
  "dense_mb4_tight 26.5 model=standard_attn size=h200 train.micro_batch_size=4"
  "moe_mb4_over 29.5 model=moe size=h200 train.micro_batch_size=4"
  "dense_long_offload_over 52.5 model=standard_attn size=h200_long recompute=selective/mlp offload=attn_norm offload.activation_offload_fraction=0.5 measure.expandable_segments=true train.micro_batch_size=1 train.global_batch_size=8"
)
if [ "${OVER:-0}" = 1 ]; then
  for spec in "${OVERS[@]}"; do
    set -- $spec
    name=$1 budget=$2; shift 2
    stamp "over $name: budget $budget GiB: $*"
    $PY -m recipes estimate --budget-gib "$budget" "$@" cluster.gpu="$PROFILE" 2>&1 | quiet | grep -E "^predicted peak|^budget"
    $PY train.py "$@" cluster.gpu="$PROFILE" measure.memory_budget_gib="$budget" $ARGS output_dir="$OUT/over/$name" 2>&1 \
      | quiet | grep -E "oom|OOM|GiB|error|fix:" | tail -6
    echo "over $name: exit ${PIPESTATUS[0]} (3 is oom)"
  done
fi
stamp done
