#!/usr/bin/env bash
# One GPU, one command, under 8 minutes: what autosplit has only shown on gloo CPU ranks, run on CUDA + NCCL.
#
#   bash benchmarks/gpu_check.sh [--dry-run] [--budget SECONDS] [OUT_DIR]
#
# Steps (each a command with its own time limit, cut further so the whole run stays inside --budget,
# default 470 s; OUT_DIR default gpu-check-<date>):
#   env         nvidia-smi, torch, CUDA and NCCL versions                              -> env.log
#   check       python -m autosplit check at world size 1 (NCCL on cuda:0): numerics of every
#               configuration one rank allows, compiled stages included, the profile, the tiny ViT's
#               prediction                                                            -> check/, check.log
#   cuda-graphs compile_stages with CUDA-graph modes must be refused by name            -> cuda-graphs.log
#   kernel-fit  python -m autosplit profile alone: this GPU's kernel sweep, fitted     -> profile-alone.json
#   bench-gpu   benchmarks/bench_gpu.py's correctness table (1f1b, zb-h1, recompute, bf16 autocast
#               against plain PyTorch on the GPU)                                     -> bench-gpu.log
#   steps       ViT-B/16, ViT-L/16 (3 batch sizes) and ViT-H/14 (2) in fp32 and bf16, one microbatch
#               per step, each timed beside the built-in H100 profile's prediction
#               (autosplit check --parts prediction --device h100)                  -> steps/<model>-<dtype>/
#   summary     every PASS / FAIL line, and each step's exit status and seconds     -> summary.txt, steps.tsv
# --dry-run prints each step (its limit and command) and runs nothing; it needs no GPU.
# Run it in the repository root after `pip install -e .` (PYTHON names the interpreter, default python): there
# a non-editable install is shadowed by autosplit/, which lacks passes/ and cost_model/ (setup.py renames them).
set -u

DRY=0
BUDGET=470
OUT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --budget) shift; BUDGET="$1" ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) OUT="$1" ;;
    esac
    shift
done
OUT="${OUT:-gpu-check-$(date +%Y%m%d-%H%M%S)}"
PY="${PYTHON:-python}"
RUN1="$PY -m torch.distributed.run --standalone --nproc-per-node 1"
START=$(date +%s)
N=0
FAILED=0

# step NAME LIMIT_S LOG COMMAND...: print it; unless --dry-run, run it under the smaller of its limit and
# the time left in the budget, its output into OUT/LOG, its status and seconds into OUT/steps.tsv
step() {
    local name="$1" limit="$2" log="$3"
    shift 3
    N=$((N + 1))
    echo "step $N: $name (limit ${limit} s) -> $OUT/$log: $*"
    [ "$DRY" = 1 ] && return 0
    local left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt 10 ]; then
        echo "  skipped: the budget of $BUDGET s is spent"
        printf '%s\t%s\t%s\n' "$name" "skipped" "0" >> "$OUT/steps.tsv"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    mkdir -p "$(dirname "$OUT/$log")"
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$log" 2>&1
    local rc=$?
    local took=$(($(date +%s) - t0))
    [ "$rc" != 0 ] && FAILED=$((FAILED + 1))
    printf '%s\t%s\t%s\n' "$name" "$rc" "$took" >> "$OUT/steps.tsv"
    echo "  exit $rc after $took s$([ "$rc" = 124 ] && echo ' (time limit)')"
    grep -E '^[a-z]+: (PASS|FAIL)|^check: ' "$OUT/$log" | sed 's/^/  /'
}

if [ "$DRY" = 0 ]; then
    mkdir -p "$OUT"
    : > "$OUT/steps.tsv"
fi

step env 20 env.log bash -c "nvidia-smi; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name(), torch.cuda.nccl.version())'"

step check 120 check.log $RUN1 -m autosplit check --out "$OUT/check"

step cuda-graphs 30 cuda-graphs.log $PY -c '
from autosplit.errors import AutosplitError
from autosplit.runtime.pipeline.compiled_stages import compile_settings
for settings in ({"mode": "reduce-overhead"}, {"mode": "max-autotune"}, {"options": {"triton.cudagraphs": True}}):
    try:
        compile_settings(settings)
    except AutosplitError as exc:
        print(f"refused {settings}: {exc}")
    else:
        raise SystemExit(f"cuda-graphs: FAIL {settings} was accepted")
print("cuda-graphs: PASS every CUDA-graph mode refused by name")'

step kernel-fit 45 kernel-fit.log $PY -m autosplit profile --out "$OUT/profile-alone.json" --seconds 5

step bench-gpu 40 bench-gpu.log $PY -c '
import sys, torch
sys.path.insert(0, "benchmarks")
import bench_gpu
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
bench_gpu._one_rank_world()
print("\n".join(bench_gpu.correctness()))'

# model, batch sizes (rows of the one microbatch), limit per dtype
for spec in "vit_base_patch16_224 32,64,128 40" "vit_large_patch16_224 16,32,64 50" "vit_huge_patch14_224 8,16 55"; do
    set -- $spec
    for dtype in fp32 bf16; do
        cast=""
        [ "$dtype" = bf16 ] && cast="--autocast bf16"
        step "steps $1 $dtype" "$3" "steps/$1-$dtype.log" env OMP_NUM_THREADS=8 $RUN1 -m autosplit check \
            --parts prediction --model "$1" --mesh 1,1,1 --batch "$2" --num-microbatches 1 $cast --device h100 \
            --timed-steps 5 --out "$OUT/steps/$1-$dtype"
    done
done

echo "step $((N + 1)): summary -> $OUT/summary.txt"
if [ "$DRY" = 0 ]; then
    grep -hE '^[a-z-]+: (PASS|FAIL)|^  (PASS|FAIL) |^    step: |^check: ' "$OUT"/*.log "$OUT"/steps/*.log \
        > "$OUT/summary.txt" 2>/dev/null
    echo "$(($(date +%s) - START)) s in all; $FAILED step(s) exited non-zero; results in $OUT"
    [ "$FAILED" = 0 ]
fi
