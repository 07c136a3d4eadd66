#!/usr/bin/env bash
# A long training run on real text, killed with -9 once and resumed (docs/evidence/long-run): the project's
# preprocessing makes the dataset (every non-empty UTF-8 .py file of Python's standard library, byte
# tokenizer; 10.7 MB on the H200 machine, so 2,000 steps of 8,192 tokens see it about 1.5 times), then
#   1. an 8-step sweep point with the same settings gives the tokens/s to compare with;
#   2. the run trains ITERS steps with a cosine schedule, checkpointing every INTERVAL steps;
#   3. at step KILL_AT it is killed with -9 (the controller; its worker dies with it);
#   4. the same command again resumes from the newest complete checkpoint (checkpoint.resume=auto);
#   5. benchmarks/plot_long_run.py draws the loss and tokens/s through the kill into $DOCS (results/long-run/);
#   6. tools/evidence.py packs the results, the summary and the plot into docs/evidence/long-run.jsonl.gz (.md, .png).
# One H200 by default (size=h200: 8 layers, hidden 2048, 16 heads, ffn 8192, sequence 4096,
# micro-batch 2); on a CPU in minutes: SIZE=tiny ITERS=60 INTERVAL=20 KILL_AT=50 MEASURE_AT=41
# EXTRA="model.num_layers=4 model.hidden_size=256" (EXTRA: more overrides for every run).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 WANDB_MODE=${WANDB_MODE:-offline}
PY=${PY:-python3}
SIZE=${SIZE:-h200}; ITERS=${ITERS:-2000}; INTERVAL=${INTERVAL:-500}; KILL_AT=${KILL_AT:-1150}
MEASURE_AT=${MEASURE_AT:-1501}   # the long run's measured window: 5 steps from here (after the resume)
DOCS=${DOCS:-results/long-run}; RUN_DIR=${RUN_DIR:-results/long_run}
PREFIX=data/stdlib_py
SETTINGS="size=$SIZE data=indexed data.paths=[${PREFIX}_text_document] profile=none train.lr=3e-4 train.min_lr=3e-5
  train.lr_decay_style=cosine ${EXTRA:-}"
RUN="$SETTINGS train.train_iters=$ITERS train.lr_warmup_iters=$((ITERS / 20)) train.log_interval=10
  data.eval_interval=100 checkpoint=default checkpoint.interval=$INTERVAL checkpoint.keep_last=2
  measure.start_step=$MEASURE_AT output_dir=$RUN_DIR"
stamp() { echo "== $(date -u +%FT%TZ) $*"; }
quiet() { grep --line-buffered -v "Warning\|warn(\|^  warnings\|Evict LRU\|^ *\"\"\""; }

rm -rf "$RUN_DIR" "$RUN_DIR-8step" && mkdir -p "$DOCS" results
# the standard library's own .py files (not site-packages), non-empty and UTF-8 (a few tests are not)
stdlib_py() { $PY -c '
import pathlib, sysconfig
root = pathlib.Path(sysconfig.get_paths()["stdlib"])
for p in sorted(root.rglob("*.py")):
    if "-packages" in str(p) or not p.stat().st_size: continue
    try: p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError): continue
    print(p)'; }
stamp "data: $PY -m recipes preprocess <the standard library .py files> --output-prefix $PREFIX --append-eod"
[ -f ${PREFIX}_text_document.bin ] || $PY -m recipes preprocess $(stdlib_py) --output-prefix $PREFIX --append-eod | tail -2

# the 8-step point first, on an idle machine: run right after the long run's last 8.75 GiB checkpoint
# save it measured 10% slower, in fresh processes on an idle GPU within 2.2%
stamp "8-step sweep point, same settings: $PY train.py $SETTINGS train.train_iters=8"
$PY train.py $SETTINGS train.train_iters=8 train.log_interval=1 output_dir=$RUN_DIR-8step 2>&1 | quiet \
  > "$DOCS/console-8step.txt"
tail -2 "$DOCS/console-8step.txt"

stamp "run (killed with -9 at step $KILL_AT): $PY train.py" $RUN
$PY train.py $RUN > "$DOCS/console-1.txt" 2>&1 &
pid=$!
until grep -q "step $KILL_AT/" "$DOCS/console-1.txt" 2>/dev/null || ! kill -0 $pid 2>/dev/null; do sleep 0.5; done
kill -9 $pid; wait $pid 2>/dev/null; stamp "killed -9 after step $KILL_AT"
sleep 2  # the worker dies with its controller (PDEATHSIG); let it go
quiet < "$DOCS/console-1.txt" > "$DOCS/console-1.tmp" && mv "$DOCS/console-1.tmp" "$DOCS/console-1.txt"

stamp "resume: the same command"
$PY train.py $RUN 2>&1 | quiet > "$DOCS/console-2.txt"
tail -3 "$DOCS/console-2.txt"

cp "$RUN_DIR/progress.jsonl" "$DOCS/progress.jsonl"
cp "$RUN_DIR/result.json" "$DOCS/long-result.json"
cp "$RUN_DIR-8step/result.json" "$DOCS/8step-result.json"
rm -rf "$RUN_DIR/checkpoints" "$RUN_DIR-8step/checkpoints"
$PY benchmarks/plot_long_run.py "$DOCS" --kill-at "$KILL_AT" | tee "$DOCS/summary.txt"
[ "$SIZE" = h200 ] && [ -z "${EXTRA:-}" ] && $PY tools/evidence.py pack long-run "$DOCS" --sweeps --image "$DOCS/long-run.png" \
  --text "$DOCS/summary.txt" "$DOCS/progress.jsonl" "$DOCS/long-result.json" "$DOCS/8step-result.json" \
  --date "$(date -u +%F)" --gpu "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)" \
  --versions "$($PY -c "import sys, torch, megatron.core as m; print('Python', sys.version.split()[0], 'torch', torch.__version__, 'megatron-core', m.__version__)")" \
  --command "bash benchmarks/gpu_long_run.sh"
stamp done
