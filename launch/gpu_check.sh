#!/usr/bin/env bash
# The device check: on one GPU node (an H200: FP8 tensor cores, no FP4) with no network, in one
# command of under 9 minutes, the figures the README's "The device check" section explains.
#
#   bash launch/gpu_check.sh                  # 1.3B, --bf16, TP=1, micro-batch 8, 6 iterations per recipe
#   DRY_RUN=1 bash launch/gpu_check.sh        # check the wheels, print every step's command, run nothing
#   FETCH_WHEELS=1 bash launch/gpu_check.sh   # on a machine with network: download the wheels into .whl/
#   MODEL_SIZE=350m bash launch/gpu_check.sh  # a smaller model if 1.3B does not fit the time
#   STEPS="0 2" bash launch/gpu_check.sh      # only some steps (numbered below)
#   BUDGET_SCALE=3 bash launch/gpu_check.sh   # every step's budget x3 (a slower or shared machine)
#
# What the node lacks travels as cp312 wheels in .whl/ beside the checkout (the list is WHEELS
# below: megatron-core 0.16.x is required, torchao optional; the rest are pure-Python or cp312
# wheels of what the training path imports, used only where the node lacks them). FETCH_WHEELS=1
# downloads them with `pip download --no-deps --only-binary=:all: --python-version 3.12`.
# Before any step the script names each missing module and the wheel that provides it, and stops.
#
# At most 8 files land in $OUT (default runs/gpu_check): environment.txt, pytest_gpu.txt,
# bench_kernels.txt, bench_kernels.json, bench_pretrain.txt, bench_pretrain.md, bench_pretrain.json;
# the pretraining runs' own logs stay in $WORK. Steps, each under its own `timeout`, in this order
# so the slow ones cannot cut the quick ones:
#   0. versions, the torch APIs the GPU path uses, the GEMM path of each format               (45 s)
#   1. pytest -m gpu, GEMM backends against the emulated spec, BF16 output = FP32 output rounded (60 s)
#   2. pytest -m gpu, Triton quantizers and cast-transpose bit-exact (cold compiles)           (100 s)
#   3. pytest -m gpu, the megatron engine (two-process cases skip on one GPU)                  (40 s)
#   4. bench_kernels: host work per GEMM (ATen ops, device kernels, Triton launches: counted),
#      quantizer GB/s, policy_linear per preset vs bf16, bounded set                           (60 s)
#   5. bench_pretrain: BF16 GEMM ceiling, then bf16, fp8, wgrad_hadamard, mxfp4 tokens/s, MFU
#      (datasheet and measured ceiling), peak memory, quantizing share, ratios to bf16         (220 s)
# 45 + 60 + 100 + 40 + 60 + 220 = 525 s at most, plus the wheel check (~10 s): under 9 minutes;
# each table is written as its rows arrive.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
WORK=${WORK:-runs/gpu_check_work}
MODEL_SIZE=${MODEL_SIZE:-1.3b}
ITERS=${ITERS:-6}
PRECISIONS=${PRECISIONS:-bf16,fp8,wgrad_hadamard,mxfp4}
MICRO_BATCH=${MICRO_BATCH:-8}
GLOBAL_BATCH=${GLOBAL_BATCH:-8}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
DRY=${DRY_RUN:-0}
SITE=${SITE:-${TMPDIR:-/tmp}/lowprec-site}
STEPS=" ${STEPS:-0 1 2 3 4 5} "
BUDGET_SCALE=${BUDGET_SCALE:-1}  # an integer factor on every step's budget, for a slower machine

# module:wheel spec:required(1)/optional(0) -- what the training path imports, and its cp312 wheel
WHEELS=(
    "megatron.core:megatron-core==0.16.1:1" "torchao:torchao==0.18.0:0"
    "numpy:numpy:1" "packaging:packaging:1" "yaml:pyyaml:1" "sentencepiece:sentencepiece:1"
    "tensorboard:tensorboard:1" "absl:absl-py:1" "grpc:grpcio:1" "markdown:markdown:1"
    "google.protobuf:protobuf:1" "tensorboard_data_server:tensorboard-data-server:1"
    "werkzeug:werkzeug:1" "markupsafe:markupsafe:1" "PIL:pillow:1" "setuptools:setuptools:1"
    "pytest:pytest:1" "pluggy:pluggy:1" "iniconfig:iniconfig:1" "pygments:pygments:1"
)

if [ "${FETCH_WHEELS:-0}" = 1 ]; then
    specs=()
    for w in "${WHEELS[@]}"; do IFS=: read -r _ spec _ <<< "$w"; specs+=("$spec"); done
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d .whl "${specs[@]}"
fi

mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# ---- 0. wheels: install the carried wheel of each module this machine lacks (only those), then
# refuse, naming each module still missing and its wheel
[ -d "$SITE" ] && export PYTHONPATH="$PYTHONPATH:$SITE"
lacking() {  # print "module:spec:required" for each module of WHEELS that is not found (one process)
    "$PY" - "${WHEELS[@]}" <<'PYCHECK'
import importlib.util, sys
for w in sys.argv[1:]:
    try:
        found = importlib.util.find_spec(w.split(":")[0]) is not None
    except (ImportError, ValueError):  # a missing parent package, or a broken one
        found = False
    if not found:
        print(w)
PYCHECK
}
mapfile -t need < <(lacking)
files=()
for w in "${need[@]}"; do
    IFS=: read -r _ spec _ <<< "$w"
    name=${spec%%[=<>]*}
    f=$(compgen -G ".whl/${name//-/_}-*.whl" | head -1)
    [ -n "$f" ] && files+=("$f")
done
if [ ${#files[@]} -gt 0 ]; then
    if [ "$DRY" = 1 ]; then
        echo "would install into $SITE: ${files[*]}"
    else
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${files[@]}" \
            || echo "warning: installing ${files[*]} into $SITE failed"
        export PYTHONPATH="$PYTHONPATH:$SITE"
        mapfile -t need < <(lacking)
    fi
fi
missing=()
for w in "${need[@]}"; do
    IFS=: read -r mod spec req <<< "$w"
    if [ "$req" = 1 ]; then missing+=("$mod (wheel: $spec)"); else echo "optional: $mod missing ($spec): its comparisons are skipped"; fi
done
if [ ${#missing[@]} -gt 0 ] && { [ "$DRY" != 1 ] || [ ${#files[@]} -eq 0 ]; }; then
    echo "gpu_check.sh: missing on this machine: ${missing[*]}" >&2
    echo "gpu_check.sh: put their cp312 wheels in .whl/ beside the checkout: on a machine with network run" \
         "'FETCH_WHEELS=1 bash launch/gpu_check.sh', then copy .whl/ here" >&2
    exit 2
fi

step() {  # step N SECONDS LOGFILE CMD...: run (or, with DRY_RUN=1, print) bounded step N, appending to LOGFILE
    local n=$1 secs=$(( $2 * BUDGET_SCALE )) log=$3
    shift 3
    [[ "$STEPS" == *" $n "* ]] || return 0
    if [ "$DRY" = 1 ]; then
        echo "timeout $secs $*"
        return 0
    fi
    timeout "$secs" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && echo "(step cut at its ${secs} s budget)" | tee -a "$log"
    return "$rc"
}

status=0
echo "== 0. versions, torch APIs, GEMM paths"
[ "$DRY" != 1 ] && rm -f "$OUT"/*.txt "$OUT"/*.json "$OUT"/*.md
if [ "$DRY" = 1 ]; then
    step 0 45 "$OUT/environment.txt" "$PY" - "(versions, kernels.torch_api.api_report, GEMM paths per preset)"
else
    step 0 45 "$OUT/environment.txt" "$PY" - <<'EOF' || status=1
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
for name in ("triton", "megatron.core", "torchao"):
    try:
        mod = __import__(name, fromlist=["__version__"])
        print(name, getattr(mod, "__version__", "?"))
    except ImportError as e:
        print(name, "MISSING:", e)
from kernels.torch_api import api_report
print("\n".join(api_report()))
from kernels.backends import describe_backends
from precision import presets
dev = "cuda" if torch.cuda.is_available() else "cpu"
for i, p in enumerate(("bf16", "fp8", "mxfp4", "wgrad_hadamard", "nvfp4")):
    text = describe_backends({p: presets.get(p)}, dev)  # on sm_100 / gfx950 the first runs the format probe
    if i == 0:
        print(text.split("GEMM backends on")[0].rstrip() or "(no format probe on this device)")
    print(p + ": " + next(ln for ln in text.splitlines() if ln.startswith("GEMMs per backend")))
EOF
fi

PYTEST=("$PY" -m pytest -q -m gpu -rs -p no:cacheprovider)
echo "== 1. GEMM backends against the emulated spec"
step 1 60 "$OUT/pytest_gpu.txt" "${PYTEST[@]}" tests/kernels/test_scaled_mm.py tests/kernels/test_bf16_path.py || status=1
echo "== 2. Triton quantizers and cast-transpose, bit-exact against the reference"
step 2 100 "$OUT/pytest_gpu.txt" "${PYTEST[@]}" tests/kernels/test_triton_quant.py tests/kernels/test_triton_bf16.py \
    tests/kernels/test_cast_transpose.py || status=1
echo "== 3. the megatron engine"
step 3 40 "$OUT/pytest_gpu.txt" "${PYTEST[@]}" tests/pretrain/test_megatron_engine.py || status=1

echo "== 4. kernel benchmarks"
KB=(--formats mxfp4,nvfp4,fp8_e4m3 --impls triton,triton_bf16,cast_transpose_bf16 --presets bf16,fp8,mxfp4,wgrad_hadamard
    --repeats 3)
if [ "$DRY" = 1 ] || "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    KB+=(--size 8192 --tokens 16384 --hidden 2048 --ffn 5632)  # the 1.3B model's fc1 at micro-batch 8
else
    KB+=(--size 256 --tokens 256 --hidden 128 --ffn 64 --impls reference)  # a CPU smoke run
fi
step 4 60 "$OUT/bench_kernels.txt" "$PY" launch/bench_kernels.py "${KB[@]}" --json "$OUT/bench_kernels.json" || status=1

echo "== 5. end-to-end pretraining ($MODEL_SIZE, --bf16, TP=1, micro-batch $MICRO_BATCH, $ITERS iterations per recipe)"
BENCH=("$PY" launch/bench_pretrain.py --model-size "$MODEL_SIZE" --precisions "$PRECISIONS" --bf16-modes on
       --train-iters "$ITERS" --skip $(( ITERS / 3 )) --goals --out "$WORK/bench_pretrain")
PRETRAIN_FLAGS=(--tensor-model-parallel-size 1 --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
                --lr-warmup-iters 0)
step 5 220 "$OUT/bench_pretrain.txt" "${BENCH[@]}" -- "${PRETRAIN_FLAGS[@]}" || status=1
if [[ "$STEPS" != *" 5 "* ]]; then
    :
elif [ "$DRY" = 1 ]; then
    "${BENCH[@]}" --dry-run -- "${PRETRAIN_FLAGS[@]}"  # the runs it would start
else
    cp "$WORK/bench_pretrain/bench_pretrain.md" "$WORK/bench_pretrain/bench_pretrain.json" "$OUT/" 2> /dev/null
fi
exit $status
