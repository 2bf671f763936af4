"""TP invariance at the operand level: under TP=2, every rank's quantized operands of all three GEMMs
equal the matching slice of the TP=1 operands, bit for bit, for every preset and an MXFP6 spec --
column-parallel, column-parallel with partition stride 2 (SwiGLU's fc1) and row-parallel layers
(``tp_operand_worker.py``).

This holds because every format with a tensor-level scale (FP8, HiF8, NVFP4's FP32 scale) takes the
whole tensor's amax (the maximum over the TP group), delayed-scaling histories record those whole
amaxes, and stochastic rounding draws each element's uniform from its index in the whole tensor.
"""

import json
import os
import sys
from pathlib import Path

import pytest

from tests._dist import free_port, run_scaled

REPO = Path(__file__).resolve().parents[2]
SPECS = ["fp8", "fprop=fp8+delayed(max,4),dgrad=fp8+delayed(most_recent,1),wgrad=fp8", "mxfp4", "mxfp4_sr",
         "mxfp4_rht", "wgrad_hadamard", "nvfp4", "hif8_w8a8",
         "fprop=mxfp6_e2m3,dgrad=mxfp6_e3m2/sr@mxfp6_e2m3,wgrad=mxfp6_e2m3+sr+had16"]  # MXFP6, SR, rotation


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_operands")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(REPO / "tests/kernels/tp_operand_worker.py"), "--out", str(out),
           "--specs", ";".join(SPECS)]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = run_scaled(cmd, 600, cwd=REPO, env=env, capture_output=True, text=True)  # idle-machine budget, grows with load
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_quantizes_its_shard_as_tp1_does(reports, rank):
    r = reports[rank]
    # specs x 3 layouts x 2 steps x 3 GEMMs x 2 operands x (values + codes, scales, tensor scale)
    assert r["checked"] == len(SPECS) * 3 * 2 * 3 * 2 * 4
    assert not r["mismatches"], "\n".join(r["mismatches"][:40])
