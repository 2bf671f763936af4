#!/usr/bin/env bash
# The repository's GPU checks and benchmarks in one run, for a session that is lent a GPU machine
# (an H200 here: FP8 tensor cores, no FP4). Everything it prints also lands in $OUT (default
# runs/gpu_check): pytest_gpu.txt, bench_kernels.{txt,json}, bench_pretrain.{md,json}.
#
#   bash launch/gpu_check.sh                      # defaults: 350m, 20 iterations per recipe
#   MODEL_SIZE=tiny ITERS=3 bash launch/gpu_check.sh   # smoke run (CPU too: GPU tests skip)
#
# On the lent machine python3 has torch and triton but not megatron-core or torchao: carry them as
# wheels in .whl/ (see /work/.library/device/README.md), e.g. here
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#       megatron-core==0.16.1 torchao==0.18.0
# and the script installs them into /tmp/site first. Steps, each bounded by `timeout`:
#   1. pytest -m gpu: tensor-core GEMM backends and Triton quantizers against the emulated spec,
#      the megatron engine (DDP, optimizer; PP=2 and the distributed optimizer need 2 GPUs)
#   2. launch/bench_kernels.py at GPU sizes (quantizer GB/s, policy_linear per preset vs bf16)
#   3. launch/bench_pretrain.py: tokens/s, TFLOP/s/device, MFU and loss per recipe vs bf16, TP=1
# The three timeouts (3 + 2 + 4.5 minutes) keep the whole run inside one 10-minute device command.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
MODEL_SIZE=${MODEL_SIZE:-350m}
ITERS=${ITERS:-20}
PRECISIONS=${PRECISIONS:-bf16,fp8,wgrad_hadamard}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
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

status=0
echo "== 1. GPU tests"
timeout 180 "$PY" -m pytest -q -m gpu -rs tests/kernels tests/pretrain/test_megatron_engine.py \
    2>&1 | tee "$OUT/pytest_gpu.txt" || status=1

echo "== 2. kernel benchmarks"
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    SIZES=(--tokens 8192 --hidden 4096 --ffn 4096,14336)
else
    SIZES=()
fi
timeout 120 "$PY" launch/bench_kernels.py "${SIZES[@]}" --json "$OUT/bench_kernels.json" \
    2>&1 | tee "$OUT/bench_kernels.txt" || status=1

echo "== 3. end-to-end pretraining benchmark ($MODEL_SIZE, $ITERS iterations per recipe)"
timeout 270 "$PY" launch/bench_pretrain.py --model-size "$MODEL_SIZE" --precisions "$PRECISIONS" \
    --train-iters "$ITERS" --skip $(( ITERS / 3 )) --out "$OUT/bench_pretrain" -- \
    --global-batch-size "${GLOBAL_BATCH:-32}" --lr-warmup-iters 0 || status=1
cp "$OUT/bench_pretrain/bench_pretrain.md" "$OUT/bench_pretrain/bench_pretrain.json" "$OUT/" 2>/dev/null
exit $status
