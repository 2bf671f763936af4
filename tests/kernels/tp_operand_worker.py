"""TP=2 vs TP=1 at the operand level, run by test_tp_operands.py under ``torchrun --nproc-per-node 2``.

For every recipe and every tensor-parallel layout of a linear layer -- column-parallel (``w`` rows and
``dy`` columns sharded, ``x`` replicated), column-parallel with megatron's ``partition_stride`` 2
(SwiGLU's fused gate/up ``linear_fc1``: rank r holds chunks r and 2 + r) and row-parallel (``w`` and
``x`` columns sharded, ``dy`` replicated) -- each rank quantizes its shards of the three GEMMs'
operands through ``kernels.operand.gemm_operands`` and compares them, bit for bit, with the matching
slice of the TP=1 operands: dequantized values from the fused (eager) and reference quantizers, and
the hardware form (codes and scales, contraction axis last). Two optimizer steps, so delayed scaling
reads a history. Each rank writes ``{"checked": n, "mismatches": [...]}`` to ``OUT/rank{r}.json``.
"""

import argparse
import json
from pathlib import Path

import torch

from kernels.operand import CONTRACTION_AXES, gemm_operands
from precision import Gemm, LayerQuantState, LinearPrecision, presets
from precision.state import TPLayout

T, IN, OUT = 64, 128, 128
LAYOUTS = {"column": ("column", 1), "column_stride2": ("column", 2), "row": ("row", 1)}


def recipe_of(spec: str) -> LinearPrecision:
    return LinearPrecision.parse(spec) if "=" in spec else presets.get(spec)


def shard(full: torch.Tensor, operand: str, layout: str, rank: int, tp: int, axis_map=None) -> torch.Tensor:
    """This rank's part of a TP=1 tensor (natural layout, or the hardware layout with ``axis_map``)."""
    split, stride = LAYOUTS[layout]
    axis = {("column", "w"): 0, ("column", "dy"): 1, ("row", "w"): 1, ("row", "x"): 1}.get((split, operand))
    if axis is None or full.dim() == 0:
        return full
    if axis_map is not None:
        axis = axis_map[axis]
    chunks = full.chunk(tp * stride, dim=axis)  # megatron: rank r holds chunks r, tp + r, ...
    return torch.cat([chunks[k * tp + rank] for k in range(stride)], dim=axis)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--specs", required=True, help="';'-separated presets or LinearPrecision specs")
    args = ap.parse_args()
    torch.distributed.init_process_group("gloo")
    rank, tp = torch.distributed.get_rank(), torch.distributed.get_world_size()
    group = torch.distributed.group.WORLD
    checked, bad = 0, []
    for spec in args.specs.split(";"):
        precision = recipe_of(spec)
        for layout, (split, stride) in LAYOUTS.items():
            st1 = LayerQuantState(11, "decoder.layers.0.mlp.linear_fc1")
            st2 = LayerQuantState(11, "decoder.layers.0.mlp.linear_fc1")
            st2.amax_group, st2.tp = group, TPLayout(rank, tp, split, stride)
            hw1, hw2 = LayerQuantState(11, "hw"), LayerQuantState(11, "hw")
            hw2.amax_group, hw2.tp = group, TPLayout(rank, tp, split, stride)
            for step in range(2):
                g = torch.Generator().manual_seed(100 + step)
                full = {"x": torch.randn(T, IN, generator=g) * (1 + 3 * step),
                        "w": torch.randn(OUT, IN, generator=g) * 0.1,
                        "dy": torch.randn(T, OUT, generator=g) * (2 - step)}
                full["x"][3, IN - 5] = 40.0  # an outlier in the last shard: whole-tensor amax needs the reduction
                local = {k: shard(v, k, layout, rank, tp) for k, v in full.items()}
                for gm in Gemm:
                    names, recipe = gm.operands, precision.recipe(gm)
                    axes = CONTRACTION_AXES[gm]
                    for impl, codes, st_a, st_b in (("eager", False, st1, st2), ("reference", True, hw1, hw2)):
                        o1 = gemm_operands(gm, full[names[0]], full[names[1]], recipe, st_a, impl=impl, codes=codes)
                        o2 = gemm_operands(gm, local[names[0]], local[names[1]], recipe, st_b, impl=impl,
                                           codes=codes)
                        for name, axis, q1, q2 in ((names[0], axes[0], o1.a, o2.a), (names[1], axes[1], o1.b, o2.b)):
                            where = f"{spec} {layout} step {step} {gm.value} {name} {impl}"
                            if not codes:
                                pairs = {"values": (q1.values, q2.values, None)}
                            else:  # hardware form: contraction axis last
                                hw_axes = {axis: 1, 1 - axis: 0}
                                pairs = {"codes": (q1.codes, q2.codes, hw_axes),
                                         "scales": (q1.scales, q2.scales, hw_axes),
                                         "tensor_scale": (q1.tensor_scale, q2.tensor_scale, None)}
                            for what, (t1, t2, amap) in pairs.items():
                                checked += 1
                                if t1 is None and t2 is None:
                                    continue
                                want = shard(t1, name, layout, rank, tp, amap) if what != "tensor_scale" else t1
                                if t2 is None or want.shape != t2.shape or not torch.equal(
                                        want.view(torch.uint8) if want.dtype == torch.uint8 else want, t2):
                                    diff = (None if t2 is None or want.shape != t2.shape
                                            else int((want != t2).sum()))
                                    bad.append(f"{where} {what}: {diff} elements differ")
                st1.end_step(), st2.end_step(), hw1.end_step(), hw2.end_step()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"checked": checked, "mismatches": bad}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
