"""The Triton kernels compile for GPU targets (sm_90, sm_100) -- checked on a machine without one.

The interpreter (which the other tests use on CPU) accepts code the GPU compiler rejects, so this
compiles representative variants ahead of time to PTX and cubins with triton's bundled ptxas, in a
subprocess without TRITON_INTERPRET, and checks the PTX for what the numerics rely on: IEEE
division (``div.rn.f32``, never ``div.full``), IEEE square roots (QuEST) and no FMA contraction.
"""

import os
import sys
from pathlib import Path

import pytest

from tests._dist import run_scaled

pytest.importorskip("triton", reason="triton is not installed (pip install 'lowprec-pretrain[gpu]')")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_quant as tq

from precision.elements import ELEMENTS

ELEM = {e.name: dict(ELEM=tq._NONFINITE[e.nonfinite], EMIN=e.emin, EMAX=e.emax, MBITS=e.mbits, BIAS=e.bias,
                     MAXN=e.max_normal, SUBSCALE=2.0 ** (e.mbits - e.emin), SIGN_SHIFT=e.sign_shift)
        for e in ELEMENTS.values()}
PTRS = {"x_ptr": "*bf16", "seed_ptr": "*i64", "srp_ptr": "*i64", "codes_ptr": "*u8", "scales_ptr": "*u8", "aux_ptr": "*i64",
        "amax_ptr": "*i64"}

def build(fn, constexprs, arch, ptrs=PTRS):
    sig = {n: "constexpr" if n in constexprs else ptrs.get(n, "*fp32") if n.endswith("_ptr")
           else "fp32" if n.endswith("prescale") else "i64" for n in fn.arg_names}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                          target=GPUTarget("cuda", arch, 32), options={"enable_fp_fusion": False})

# (mode, block, elem, rot, sr, u_given, pack, rceil, prescale, keyed SR uniforms, natural-layout mode,
#  BF16 form: the BF16 operand written to dq_ptr, AMAX_OUT: per-tensor amax found while quantizing)
VARIANTS = [(0, 32, "e2m1", 16, True, False, True, True, True, True, 0, False, False),
            (0, 32, "e4m3", 32, False, True, False, False, False, False, 0, False, False),
            (1, 16, "e2m1", 16, True, True, True, False, False, False, 0, False, False),
            (2, 64, "e5m2", 0, True, False, False, False, False, False, 0, False, True),
            (1, 16, "e2m1", 0, True, False, False, False, False, True, 1, True, False),
            (2, 64, "e4m3", 16, True, False, False, False, False, True, 2, True, False),
            (0, 32, "e2m3", 0, True, False, False, True, True, True, 0, True, False)]
for arch in (90, 100):
    for mode, block, elem, rot, sr, ug, pack, rceil, pre, keyed, nat, bf16, amax_out in VARIANTS:
        tk = max(block, rot, 2)
        c = dict(MODE=mode, BLOCK=block, NB=tk // block, TILE_R=64, ROT=rot, LOG_ROT=rot.bit_length() - 1 if rot else 0,
                 ROT_C=0.25 if rot == 16 else 0.17677669529663687, HAS_SIGNS=rot == 16, RCEIL=rceil, SR=sr,
                 U_GIVEN=ug, KEYED=keyed, NAT=nat, PRESCALE=pre, TARGET=ELEM[elem]["MAXN"] if mode == 2 else 1.0,
                 MARGIN=2.0 if mode == 2 else 1.0, AMAX_OUT=amax_out, WRITE_CODES=not bf16, WRITE_DQ=True,
                 PACK=pack, BF16_FORM=bf16, CTRL=0, ERR=0, GROUP=16, TWO_D=0, **ELEM[elem])
        ptx = build(tq._quant_kernel, c, arch, {**PTRS, "dq_ptr": "*bf16"} if bf16 else PTRS).asm["ptx"]
        assert "div.full" not in ptx and "div.approx.f32" not in ptx, "approximate division"
        assert not re.search(r"fma\.rn\.f32", ptx), "FMA contraction"
        if rceil or pre or mode in (1, 2):  # the tensor-level scales are IEEE divisions too
            assert "div.rn.f32" in ptx
    build(tq._amax_kernel, dict(TILE_R=64, TK=32, ROT=32, LOG_ROT=5, ROT_C=0.17677669529663687,
                                HAS_SIGNS=False), arch)
    # the cast-transpose: MXFP4 (SR, RCEIL) by rows, NVFP4 by columns, BF16 operands both ways
    ct = {"BT": 64, "BH": 64}
    for tag, mode, block, elem, sr, rceil in (("A_", 0, 32, "e2m1", True, True), ("B_", 1, 16, "e2m1", False, False)):
        ct.update({tag + k: v for k, v in dict(MODE=mode, BLOCK=block, NB=64 // block, TILE_R=64, RCEIL=rceil, SR=sr,
                   U_GIVEN=False, KEYED=sr, NAT=0 if tag == "A_" else 1, PRESCALE=False, TARGET=1.0, MARGIN=1.0,
                   AMAX_OUT=False, WRITE_CODES=False,
                   WRITE_DQ=True, PACK=False, BF16_FORM=True, CTRL=0, ERR=0, GROUP=16, TWO_D=0,
                   **ELEM[elem]).items()})
    ptrs = {n: t for n, t in (("x_ptr", "*bf16"), ("a_dq", "*bf16"), ("b_dq", "*bf16"), ("a_scales", "*u8"),
                              ("b_scales", "*u8"), ("a_codes", "*u8"), ("b_codes", "*u8"), ("a_srp", "*i64"),
                              ("b_srp", "*i64"), ("a_seed", "*i64"), ("b_seed", "*i64"), ("a_aux", "*i64"),
                              ("b_aux", "*i64"))}
    fn = tq._cast_transpose_kernel
    sig = {n: "constexpr" if n in ct else ptrs.get(n, "*fp32" if n[2:] in ("u", "gs", "ts") else "i64")
           for n in fn.arg_names}
    sig.update({n: "fp32" for n in ("a_prescale", "b_prescale")})
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ct), target=GPUTarget("cuda", arch, 32),
                         options={"enable_fp_fusion": False}).asm["ptx"]
    assert not re.search(r"fma\.rn\.f32", ptx), "FMA contraction"
# the FP4 error controls on sm_90 (16-row tiles: a quicker compile, the same code): 4/6 on 2-D tiles
# (blocks along axis 0), MS-EDEN under rht16 with keyed uniforms, QuEST with SR under had32
CONTROLS = [dict(MODE=1, BLOCK=16, ROT=0, SR=False, CTRL=1, ERR=0, TWO_D=2),
            dict(MODE=1, BLOCK=16, ROT=16, SR=True, CTRL=2, ERR=0, TWO_D=0),
            dict(MODE=0, BLOCK=32, ROT=32, SR=True, CTRL=3, ERR=0, TWO_D=0)]
for v in CONTROLS:
    rot = v["ROT"]
    c = dict(NB=1, TILE_R=16, LOG_ROT=rot.bit_length() - 1 if rot else 0, ROT_C=0.25 if rot == 16 else 0.17677669529663687,
             HAS_SIGNS=rot == 16, RCEIL=False, U_GIVEN=False, KEYED=True, NAT=0, PRESCALE=False, TARGET=1.0, MARGIN=1.0,
             AMAX_OUT=False, WRITE_CODES=True, WRITE_DQ=True, PACK=False, BF16_FORM=False, GROUP=16, **v, **ELEM["e2m1"])
    ptx = build(tq._quant_kernel, c, 90).asm["ptx"]
    assert "div.full" not in ptx and "div.approx.f32" not in ptx and "sqrt.approx" not in ptx, "approximate"
    assert not re.search(r"fma\.rn\.f32", ptx), "FMA contraction"
    assert ("sqrt.rn.f32" in ptx) == (v["CTRL"] == 3)  # QuEST's standard deviation: an IEEE square root
print("compiled", 2 * (len(VARIANTS) + 2) + len(CONTROLS))
'''


def test_kernels_compile_for_sm90_and_sm100():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"
    r = run_scaled([sys.executable, "-c", SCRIPT], 600, capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compiled 21" in r.stdout
