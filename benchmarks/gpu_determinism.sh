#!/usr/bin/env bash
# train.deterministic on one GPU, for dense (standard_attn), MLA and MoE at the h200 size cut to 2 layers:
#   (a) two straight runs of the same command, with and without train.deterministic: every step's loss and
#       grad norm compared bit for bit (one sweep, each point its own process);
#   (b) a run with checkpoints every INTERVAL steps killed with -9 (the controller; its worker dies with it)
#       right after its first checkpoint, then the same command again (checkpoint.resume=auto): the resumed
#       steps against (a)'s straight run, bit for bit;
#   (c) each selective label of the family against none: one step's loss and every parameter's gradient
#       (megatron's fp32 main_grad), in one process (benchmarks/determinism.py labels);
#   (d) the step time with and without it: the median of each run's last 4 steps, from (a).
# Then one table (benchmarks/determinism.py table), also written to OUT/table.md:
#   bash benchmarks/gpu_determinism.sh              # about 6 minutes on one H100
# Settings (environment): PY (default .venv/bin/python, else python3), FAMILIES (standard_attn,mla,moe),
# SIZE (h200), LAYERS (2), ITERS (12 steps a run), INTERVAL (4: checkpoint steps), OUT (results/determinism),
# EXTRA (more overrides for every run), PHASES (a b c: which parts run; (d) comes from (a)'s runs). OUT is
# emptied only when (a) runs, so a later call can add (b) or (c) beside it. A CPU smoke run: SIZE=tiny
# FAMILIES=standard_attn.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
if [ -z "${PY:-}" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
FAMILIES=${FAMILIES:-standard_attn,mla,moe}
SIZE=${SIZE:-h200}; LAYERS=${LAYERS:-2}; ITERS=${ITERS:-12}; INTERVAL=${INTERVAL:-4}
OUT=${OUT:-results/determinism}
PHASES=${PHASES:-a b c}
# the measured window is the last 4 steps: what a run measures after it (profiled step, module times,
# control ledgers: passes that draw batches or update) comes after every compared step; all three off anyway
COMMON="size=$SIZE model.num_layers=$LAYERS train.train_iters=$ITERS measure.start_step=$((ITERS - 3)) measure.steps=4
  profile=none measure.module_times=false measure.ledger=false train.log_interval=1 ${EXTRA:-}"
stamp() { echo "== $(date -u +%FT%TZ) $*"; }
quiet() { grep --line-buffered -v "Warning\|warn(\|warnings.warn\|^ *\"\"\"\|DEPRECATED\|path_to_cache" | tail -"$1"; }
run() { case " $PHASES " in *" $1 "*) return 0;; *) return 1;; esac; }
if run a; then rm -rf "$OUT"; fi; mkdir -p "$OUT"
t0=$SECONDS

stamp "env"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
$PY -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)" 2>/dev/null

if run a; then
  stamp "(a) and (d): straight runs, deterministic and not, two processes each"
  $PY train.py -m model=$FAMILIES train.deterministic=true,false measure.repeat=0,1 $COMMON \
    hydra.sweep.dir=$OUT/straight 2>&1 | quiet 20
fi

for family in ${FAMILIES//,/ }; do
  run b || break
  dir=$OUT/resume_$family
  args="model=$family train.deterministic=true $COMMON checkpoint=default checkpoint.interval=$INTERVAL output_dir=$dir"
  stamp "(b) $family: killed with -9 after its step-$INTERVAL checkpoint, then resumed"
  $PY train.py $args > "$OUT/resume_$family-killed.log" 2>&1 &
  pid=$!
  until grep -q "saved step $INTERVAL to" "$OUT/resume_$family-killed.log" 2>/dev/null || ! kill -0 $pid 2>/dev/null; do
    sleep 0.05; done
  worker=$(cat "$dir/worker.pid" 2>/dev/null)
  kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null
  for _ in $(seq 100); do [ -n "$worker" ] && kill -0 "$worker" 2>/dev/null || break; sleep 0.1; done  # dies with it
  grep -o "step [0-9]*/$ITERS" "$OUT/resume_$family-killed.log" | tail -1 | sed 's/^/   killed after /'
  $PY train.py $args > "$OUT/resume_$family-resumed.log" 2>&1
  grep "\[checkpoint\] resum\|resumed\|^.*result" "$OUT/resume_$family-resumed.log" | quiet 3
done

if run c; then
  stamp "(c) each selective label against none, one step's gradients, one process"
  $PY benchmarks/determinism.py labels --families $FAMILIES "$OUT/labels.json" size=$SIZE model.num_layers=$LAYERS \
    ${EXTRA:-} 2>&1 | grep --line-buffered "regions replayed\|Error\|error"
fi

stamp "table ($((SECONDS - t0)) s in all)"
$PY benchmarks/determinism.py table "$OUT"
