#!/usr/bin/env bash
# The repository's GPU checks and issue 13's benchmarks in one command, for a session that is lent
# a GPU machine (an H200 here: FP8 tensor cores, no FP4), under 9 minutes. Everything it prints
# also lands in $OUT (default runs/gpu_check): environment.txt, pytest_gpu.txt,
# bench_kernels.{txt,json}, bench_pretrain.{md,json}.
#
#   bash launch/gpu_check.sh                              # 1.3B, --bf16, TP=1, 6 iterations per recipe
#   MODEL_SIZE=350m bash launch/gpu_check.sh              # if 1.3B does not fit the time
#   DRY_RUN=1 bash launch/gpu_check.sh                    # print every step's command, run nothing
#   MODEL_SIZE=tiny ITERS=3 GLOBAL_BATCH=4 bash launch/gpu_check.sh   # CPU smoke (GPU tests skip)
#
# On the lent machine python3 has torch and triton but not megatron-core or torchao: carry them as
# wheels in .whl/ (see /work/.library/device/README.md), e.g. here
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#       megatron-core==0.16.1 torchao==0.18.0
# and the script installs them into /tmp/site first. Steps, each bounded by `timeout`:
#   1. pytest -m gpu: the bf16_mm backend (cuBLAS BF16, FP32 output) and the tensor-core GEMM
#      backends against the emulated spec, Triton quantizers (BF16 operands, cast-transpose),
#      the megatron engine                                                               (100 s)
#   2. launch/bench_kernels.py at GPU sizes: quantizer GB/s, policy_linear per preset vs bf16 (70 s)
#   3. launch/bench_pretrain.py, TP=1, --bf16: bf16, fp8, wgrad_hadamard, mxfp4 -- BF16 MFU
#      (goal >= 40 %), fp8 tokens/s vs BF16 (goal >= 1.3x), emulated wgrad_hadamard / mxfp4 step
#      time vs BF16 (goals <= 1.35x / <= 1.3x), peak memory per recipe, the fraction of step time
#      spent quantizing; the issue's goals are checked under the table; the table is rewritten
#      after every run, so a timeout keeps the runs done                                    (330 s)
# 100 + 70 + 330 s of steps plus start-up keep the whole run under 9 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
MODEL_SIZE=${MODEL_SIZE:-1.3b}
ITERS=${ITERS:-6}
PRECISIONS=${PRECISIONS:-bf16,fp8,wgrad_hadamard,mxfp4}
GLOBAL_BATCH=${GLOBAL_BATCH:-8}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
DRY=${DRY_RUN:-0}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step SECONDS LOGFILE CMD...: run (or, with DRY_RUN=1, print) one bounded step
    local secs=$1 log=$2
    shift 2
    if [ "$DRY" = 1 ]; then
        echo "timeout $secs $*"
        return 0
    fi
    timeout "$secs" "$@" 2>&1 | tee "$log"
}

if [ "$DRY" != 1 ] && compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [ "$DRY" != 1 ]; then
"$PY" - <<'EOF' 2>&1 | tee "$OUT/environment.txt"
import torch
print("torch", torch.__version__, "| cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
for name in ("megatron.core", "torchao", "triton"):
    try:
        mod = __import__(name, fromlist=["__version__"])
        print(name, getattr(mod, "__version__", "?"))
    except Exception as e:  # noqa: BLE001 - report, do not stop
        print(name, "MISSING:", type(e).__name__, e)
EOF
fi

status=0
echo "== 1. GPU tests"
step 100 "$OUT/pytest_gpu.txt" "$PY" -m pytest -q -m gpu -rs tests/kernels tests/pretrain/test_megatron_engine.py \
    || status=1

echo "== 2. kernel benchmarks"
SIZES=()
if [ "$DRY" != 1 ] && "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    SIZES=(--tokens 8192 --hidden 4096 --ffn 4096,14336 --repeats 3)
fi
step 70 "$OUT/bench_kernels.txt" "$PY" launch/bench_kernels.py "${SIZES[@]}" --json "$OUT/bench_kernels.json" \
    || status=1

echo "== 3. end-to-end pretraining benchmark ($MODEL_SIZE, --bf16, TP=1, $ITERS iterations per recipe)"
BENCH=("$PY" launch/bench_pretrain.py --model-size "$MODEL_SIZE" --precisions "$PRECISIONS" --bf16-modes on
       --train-iters "$ITERS" --skip $(( ITERS / 3 )) --goals --out "$OUT/bench_pretrain")
PRETRAIN_FLAGS=(--tensor-model-parallel-size 1 --global-batch-size "$GLOBAL_BATCH" --lr-warmup-iters 0)
step 330 "$OUT/bench_pretrain.txt" "${BENCH[@]}" -- "${PRETRAIN_FLAGS[@]}" || status=1
[ "$DRY" = 1 ] && "${BENCH[@]}" --dry-run -- "${PRETRAIN_FLAGS[@]}"  # the runs it would start
[ "$DRY" != 1 ] && cp "$OUT/bench_pretrain/bench_pretrain.md" "$OUT/bench_pretrain/bench_pretrain.json" "$OUT/" 2>/dev/null
exit $status
