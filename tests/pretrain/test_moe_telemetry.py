"""MoE telemetry (``pretrain.trainer.moe_telemetry``) and its report section (``pretrain.evaluation.moe_report``).

The scalars are checked against independent numbers: every routed token makes top-k assignments, so
the tokens per expert plus the dropped ones add up to global batch x sequence x top-k; the load CV is
recomputed from the per-expert counts with numpy; megatron's aux-loss tracker values are the ones
the layer also logs; a run's report carries the section."""

import math

import numpy as np
import pytest
import torch

from pretrain.evaluation.moe_report import load_moe, moe_section
from pretrain.trainer.moe_telemetry import routing_scalars

from ._launch import TINY, run_pretrain, scalars
from .test_moe_resume import MOE


def test_routing_scalars_against_numpy():
    tokens = np.array([[10.0, 0.0, 30.0, 20.0], [15.0, 15.0, 15.0, 15.0]])
    dropped, count = np.array([4.0, 0.0]), np.array([32.0, 30.0])
    entropy = np.array([20.0, 30.0 * math.log(4)])
    table = torch.tensor(np.column_stack([tokens, dropped, entropy, count]))
    got = dict(routing_scalars([0, 2], table, 4))
    for i, layer in enumerate((0, 2)):
        assert got[f"moe/layer_{layer}/load_cv"] == pytest.approx(tokens[i].std() / tokens[i].mean())
        assert got[f"moe/layer_{layer}/dropped_fraction"] == pytest.approx(dropped[i] / (tokens[i].sum() + dropped[i]))
        assert got[f"moe/layer_{layer}/router_entropy"] == pytest.approx(entropy[i] / count[i] / math.log(4))
        assert got[f"moe/layer_{layer}/tokens_expert_2"] == tokens[i][2]
    assert got["moe/layer_2/load_cv"] == 0 and got["moe/layer_2/router_entropy"] == pytest.approx(1.0)
    assert got["moe/load_cv"] == pytest.approx(tokens[0].std() / tokens[0].mean() / 2)


@pytest.mark.slow
def test_moe_telemetry_in_tensorboard_and_report_with_grouped_experts(tmp_path, data_cache):
    tb = tmp_path / "tb"
    # grouped expert GEMMs: expert 0 in BF16 (torch._grouped_mm), experts 1-3 in MXFP4 (the per-expert loop)
    proc = run_pretrain(["--train-iters", "2", *TINY, *MOE, "--precision", "bf16", "--precision-rule", "experts:0-0=bf16",
                         "--precision-rule", "kind:expert=mxfp4", "--moe-grouped-gemm",
                         "--moe-expert-capacity-factor", "1.0", "--numerics-interval", "2", "--eval-interval", "100",
                         "--data-cache-dir", str(data_cache), "--tensorboard-dir", str(tb)], nproc=0)
    assert "  fprop: bf16 -> torch._grouped_mm, operands emulated; mxfp4 -> per-expert loop, operands emulated" \
        in proc.stdout
    assignments = 4 * 64 * 2  # global batch 4 x 64 tokens x top-2
    for layer in (0, 1):
        for step in (1, 2):
            counts = np.array([scalars(tb, f"moe/layer_{layer}/tokens_expert_{e}")[step] for e in range(4)])
            dropped = scalars(tb, f"moe/layer_{layer}/dropped_fraction")[step]
            assert counts.sum() == pytest.approx((1 - dropped) * assignments)
            assert counts.max() <= math.ceil(4 * 64 * 2 / 4 * 1.0)  # capacity: an even share x 1.0
            assert scalars(tb, f"moe/layer_{layer}/load_cv")[step] == pytest.approx(counts.std() / counts.mean(), rel=1e-5)
            assert 0 < scalars(tb, f"moe/layer_{layer}/router_entropy")[step] <= 1
        lb = scalars(tb, f"moe/load_balancing_loss_layer_{layer}")
        assert set(lb) == {1, 2} and all(v > 0 for v in lb.values())
        assert set(scalars(tb, f"moe/z_loss_layer_{layer}")) == {1, 2}
        sqnr = scalars(tb, f"moe/layer_{layer}/expert_3/sqnr_db_min")
        assert set(sqnr) == {2} and 5 < sqnr[2] < 40  # MXFP4: ~17 dB on Gaussian-like operands
        fc1 = scalars(tb, f"moe/layer_{layer}/expert_3/fc1/fprop/x/sqnr_db")[2]
        assert fc1 >= sqnr[2]
    section = moe_section(load_moe(tmp_path))
    assert section.startswith("## Mixture of experts (step 2)") and "| 1 |" in section
