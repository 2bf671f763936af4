#!/usr/bin/env bash
# The device check: on one bare GPU node (an H100 or H200: FP8 tensor cores, no FP4; Python 3.12,
# torch and triton installed, no network), in one command of at most 8 minutes including the
# installation of what the node lacks, the figures the README's "The device check" section explains.
#
#   bash launch/gpu_check.sh                  # 1.3B, --bf16, TP=1, micro-batch 8 x 2 (accumulated)
#   DRY_RUN=1 bash launch/gpu_check.sh        # check the wheels, print every step's command, run nothing
#   FETCH_WHEELS=1 bash launch/gpu_check.sh   # on a machine with network: download the wheels into .whl/
#   MODEL_SIZE=350m bash launch/gpu_check.sh  # a smaller model if 1.3B does not fit the time
#   STEPS="0 2" bash launch/gpu_check.sh      # only some steps (numbered below)
#   BUDGET_SCALE=3 bash launch/gpu_check.sh   # every step's budget x3 (a slower or shared machine)
#
# What must travel: the checkout and, beside it, the ignored folder .whl/ with the cp312 wheels of
# WHEELS below (megatron-core 0.16.x required, torchao optional; the rest are what the training
# path imports, used only where the node lacks them). FETCH_WHEELS=1 downloads them with
# `pip download --no-deps --only-binary=:all: --python-version 3.12` on a machine with network.
# Before any step the script installs the carried wheels the node needs (into $SITE, nothing else
# touched), names in one line each module still missing and the wheel that provides it, and stops.
#
# At most 8 files land in $OUT (default runs/gpu_check): environment.txt, pytest_gpu.txt,
# bench_pretrain.txt, bench_pretrain.md, bench_pretrain.json, bench_kernels.txt, bench_kernels.json;
# the pretraining runs' own logs stay in $WORK. Steps in order of value, each in its own session
# under its own `timeout` (killed with its children at the budget; whatever a step leaves in its
# session is killed when it ends, so no step leaves a process holding the GPU), each table written
# as its rows arrive:
#   0. versions, the torch APIs the GPU path uses, the start-up probe and the path each format's
#      GEMMs take (kernels.probe), the device found and its dense peaks                       (40 s)
#   1. pytest -m gpu: Triton quantizers and cast-transpose bit-exact against the reference      (90 s)
#   2. bench_pretrain 1.3B, hardware paths first: bf16, fp8, wgrad_hadamard tokens/s; global
#      batch 2 x micro-batch (gradient accumulation: the optimizer step is not every timed
#      iteration), 10 timed iterations after 3 of warm-up; MFU against the found device's BF16
#      peak by name and the BF16 GEMM ceiling measured in the run, FP8 rows also against the FP8
#      peak                                                                                     (200 s)
#   3. pytest -m gpu: GEMM backends against the emulated spec; BF16 output as cuBLAS promises it;
#      one linear's operand pipeline (Triton quantizers included) under torch.compile(fullgraph=True) (45 s)
#   4. bench_kernels: host work per GEMM and per linear step (counted), bounded quantizer and
#      policy_linear tables at the 1.3B's fc1 (2048 -> 11264 under SwiGLU)                      (45 s)
#   5. pytest -m gpu: the megatron engine (two-process cases skip on one GPU)                   (30 s)
# 40 + 90 + 200 + 45 + 45 + 30 = 450 s at most, plus the wheel installation (~20 s): under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
WORK=${WORK:-runs/gpu_check_work}
MODEL_SIZE=${MODEL_SIZE:-1.3b}
WARMUP=${WARMUP:-3}
TIMED=${TIMED:-10}
ITERS=$(( WARMUP + TIMED ))
PRECISIONS=${PRECISIONS:-bf16,fp8,wgrad_hadamard}
MICRO_BATCH=${MICRO_BATCH:-8}
GLOBAL_BATCH=${GLOBAL_BATCH:-$(( 2 * MICRO_BATCH ))}
if [ "$GLOBAL_BATCH" -le "$MICRO_BATCH" ] || [ $(( GLOBAL_BATCH % MICRO_BATCH )) != 0 ]; then
    echo "gpu_check.sh: GLOBAL_BATCH=$GLOBAL_BATCH must be a multiple of MICRO_BATCH=$MICRO_BATCH larger than it" \
         "(gradient accumulation keeps the optimizer step out of most timed iterations)" >&2
    exit 2
fi
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

SESSION=$(command -v setsid || true)  # util-linux; without it a step shares the script's session
step() {  # step N SECONDS LOGFILE CMD...: run (or, with DRY_RUN=1, print) bounded step N, appending to LOGFILE
    local n=$1 secs=$(( $2 * BUDGET_SCALE )) log=$3
    shift 3
    [[ "$STEPS" == *" $n "* ]] || return 0
    if [ "$DRY" = 1 ]; then
        echo "timeout -k 10 $secs $*"
        return 0
    fi
    # its own session: at the budget timeout signals the step's whole process group (TERM, then KILL
    # 10 s later); afterwards anything still in the session (a worker that outlived its launcher) is
    # killed, so the next step finds the GPU free
    # (stdin passed on through fd 3: an asynchronous command's own stdin would be /dev/null)
    { $SESSION timeout -k 10 "$secs" "$@" <&3 3<&- > >(tee -a "$log") 2>&1 & } 3<&0
    local pid=$!
    wait "$pid"
    local rc=$?
    [ -n "$SESSION" ] && kill -KILL -- "-$pid" 2> /dev/null
    [ "$rc" = 124 ] && echo "(step cut at its ${secs} s budget)" | tee -a "$log"
    return "$rc"
}

status=0
echo "== 0. versions, torch APIs, GEMM paths, the device and its peaks"
[ "$DRY" != 1 ] && rm -f "$OUT"/*.txt "$OUT"/*.json "$OUT"/*.md
if [ "$DRY" = 1 ]; then
    step 0 40 "$OUT/environment.txt" "$PY" - "(versions, kernels.torch_api.api_report, the probe, GEMM paths per preset)"
else
    step 0 40 "$OUT/environment.txt" "$PY" - "$WORK/peaks.env" <<'EOF' || status=1
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
import sys
from kernels.probe import startup_report
from precision import presets
dev = "cuda" if torch.cuda.is_available() else "cpu"
for p in ("bf16", "fp8", "mxfp4", "wgrad_hadamard", "nvfp4"):
    lines = startup_report({p: presets.get(p)}, dev).splitlines()  # on a GPU: the probe of each format pair first
    head = lines[:next(i for i, ln in enumerate(lines) if ln.startswith("GEMM backends on"))]
    print("\n".join(head) if head else f"{p}: no format probe here")
    print(p + ": " + next(ln for ln in lines if ln.startswith("GEMMs per backend")))
    paths = lines.index(next(ln for ln in lines if ln.startswith("GEMM paths per format")))
    print("\n".join(lines[paths + 1:]))  # each GEMM's path per format pair; the WARNING line if any
# dense peaks (TFLOP/s) of the device found, by its name: the MFU denominators of step 2
PEAKS = [("H100 PCIe", 756.0, 1513.0), ("H100 NVL", 835.0, 1671.0), ("H100", 989.0, 1979.0),
         ("H200", 989.0, 1979.0), ("B200", 2250.0, 4500.0)]
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
found = next(((k, b, f) for k, b, f in PEAKS if k.replace(" ", "") in name.replace(" ", "")), None)
with open(sys.argv[1], "w") as env:
    if found:
        print(f"device: {name} -> {found[0]}: dense BF16 {found[1]:g}, FP8 {found[2]:g} TFLOP/s")
        env.write(f"PEAK_BF16={found[1]:g}\nPEAK_FP8={found[2]:g}\nDEVICE='{found[0]}'\n")
    else:
        print(f"device: {name}: no known dense peak (MFU against the measured BF16 GEMM ceiling only)")
EOF
fi

PYTEST=("$PY" -m pytest -q -m gpu -rs -p no:cacheprovider)
echo "== 1. Triton quantizers and cast-transpose, bit-exact against the reference"
step 1 90 "$OUT/pytest_gpu.txt" "${PYTEST[@]}" tests/kernels/test_triton_quant.py tests/kernels/test_triton_bf16.py \
    tests/kernels/test_cast_transpose.py || status=1

echo "== 2. end-to-end pretraining ($MODEL_SIZE, --bf16, TP=1, micro-batch $MICRO_BATCH, global batch $GLOBAL_BATCH," \
     "$TIMED timed iterations after $WARMUP per recipe: $PRECISIONS)"
PEAK_FLAGS=()
[ -f "$WORK/peaks.env" ] && . "$WORK/peaks.env"
[ -n "${PEAK_BF16:-}" ] && PEAK_FLAGS=(--peak-tflops "$PEAK_BF16")
BENCH=("$PY" launch/bench_pretrain.py --model-size "$MODEL_SIZE" --precisions "$PRECISIONS" --bf16-modes on
       --train-iters "$ITERS" --skip "$WARMUP" --goals "${PEAK_FLAGS[@]}" --out "$WORK/bench_pretrain")
PRETRAIN_FLAGS=(--tensor-model-parallel-size 1 --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
                --lr-warmup-iters 0)
step 2 200 "$OUT/bench_pretrain.txt" "${BENCH[@]}" -- "${PRETRAIN_FLAGS[@]}" || status=1
if [[ "$STEPS" != *" 2 "* ]]; then
    :
elif [ "$DRY" = 1 ]; then
    "${BENCH[@]}" --dry-run -- "${PRETRAIN_FLAGS[@]}"  # the runs it would start
else
    cp "$WORK/bench_pretrain/bench_pretrain.md" "$WORK/bench_pretrain/bench_pretrain.json" "$OUT/" 2> /dev/null
    if [ -n "${PEAK_FP8:-}" ] && [ -f "$OUT/bench_pretrain.json" ]; then  # FP8 rows also against the FP8 peak
        "$PY" - "$OUT/bench_pretrain.json" "$PEAK_FP8" "${DEVICE:-}" <<'EOF' | tee -a "$OUT/bench_pretrain.txt"
import json, sys
peak = float(sys.argv[2])
for r in json.load(open(sys.argv[1]))["runs"]:
    if r.get("precision", "").startswith("fp8") and r.get("tflops_per_device") == r.get("tflops_per_device"):
        print(f"{r['precision']}: {r['tflops_per_device']:.0f} TFLOP/s = {100 * r['tflops_per_device'] / peak:.1f}% "
              f"of the {sys.argv[3]} dense FP8 peak ({peak:g} TFLOP/s)")
EOF
    fi
fi

echo "== 3. GEMM backends against the emulated spec; the operand pipeline without graph breaks"
step 3 45 "$OUT/pytest_gpu.txt" "${PYTEST[@]}" tests/kernels/test_scaled_mm.py tests/kernels/test_bf16_path.py \
    tests/kernels/test_operand_compile.py || status=1

echo "== 4. kernel benchmarks"
KB=(--formats mxfp4,nvfp4,fp8_e4m3 --impls triton,triton_bf16,cast_transpose_bf16 --presets bf16,fp8,mxfp4,wgrad_hadamard
    --repeats 3)
if [ "$DRY" = 1 ] || "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    KB+=(--size 8192 --tokens 16384 --hidden 2048 --ffn 11264)  # the 1.3B model's fc1 (SwiGLU) at micro-batch 8
else
    KB+=(--size 256 --tokens 256 --hidden 128 --ffn 64 --impls reference)  # a CPU smoke run
fi
step 4 45 "$OUT/bench_kernels.txt" "$PY" launch/bench_kernels.py "${KB[@]}" --json "$OUT/bench_kernels.json" || status=1

echo "== 5. the megatron engine"
step 5 30 "$OUT/pytest_gpu.txt" "${PYTEST[@]}" tests/pretrain/test_megatron_engine.py || status=1
exit $status
