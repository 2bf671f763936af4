"""TP=2 generation equals TP=1 (``generate_tp_worker.py`` under ``torchrun --nproc-per-node 2``, gloo).

Both styles (RoPE + GQA; learned absolute positions), greedy under the model's FP32 plan and under
the ``mxfp4`` and ``fp8`` rollout presets, sampled under ``nvfp4``. Tokens must be equal and both
ranks must agree (each samples from the all-gathered logits with the same seeded generator);
log-probs agree to the float rounding of the row-parallel all-reduce (summation order). Measured:
``mxfp4`` bit-identical; FP32 plan and ``nvfp4`` <= 2.2e-6; ``fp8`` 1.4e-4 -- an all-reduce
last-bit difference flipped one per-tensor FP8 activation rounding (hence its own tolerance).
A MoE policy (4 experts, top-2, a shared expert): the same, and the recorded experts of every position
equal -- decode steps of 3 rows at TP=2 pad the MoE layer's tokens to a multiple of TP (``model.moe``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import free_port

REPO = Path(__file__).resolve().parents[2]
TOL = {"model": 1e-4, "mxfp4": 1e-4, "fp8": 1e-3, "nvfp4_sampled": 1e-4}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen_tp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(REPO / "tests/model/generate_tp_worker.py"), "--out", str(out)]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("style", ["llama", "gpt2", "moe"])
@pytest.mark.parametrize("run", ["model", "mxfp4", "fp8", "nvfp4_sampled"])
def test_tp2_generation_equals_tp1(reports, style, run):
    r0, r1 = (rep[style] for rep in reports)
    assert r0["tp2"][run]["tokens"] == r1["tp2"][run]["tokens"]  # both ranks generated the same
    tp1, tp2 = r0["tp1"][run], r0["tp2"][run]
    assert tp2["tokens"] == tp1["tokens"]
    diff = max(abs(a - b) for x, y in zip(tp1["logprobs"], tp2["logprobs"]) for a, b in zip(x, y))
    assert diff < TOL[run], diff
    if style == "moe":  # the same experts at every position and layer, on both ranks
        assert tp2["experts"] == tp1["experts"] == r1["tp2"][run]["experts"]
