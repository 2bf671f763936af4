"""Grouped expert GEMMs (``--moe-grouped-gemm``): all local experts' fc1 and fc2 as one policy GEMM each.

Megatron's ``SequentialMLP`` runs one MLP per expert, so a layer of E experts makes 2 x E Fprop calls
(and as many Dgrad and Wgrad calls) of a few rows each. ``GroupedSequentialMLP`` keeps the same
experts -- the same modules, parameters, names, quantization states and checkpoints -- and runs each
of fc1 and fc2 as one grouped GEMM over the experts (``_GroupedLinearFn``: one autograd function,
three labelled GEMM blocks)::

    tokens [T, h], split by expert e into x_e [T_e, h]    (each padded to model.moe.token_bucket rows)

    === FPROP: y_e  = x_e  · w_eᵀ  ===   for every e in one call   [T, in] x [E, out, in]  -> [T, out]
    === DGRAD: dx_e = dy_e · w_e   ===   for every e in one call   [T, out] x [E, out, in] -> [T, in]
    === WGRAD: dw_e = dy_eᵀ· x_e   ===   for every e in one call   [out, T] x [T, in] -> [E, out, in]
                                          (contraction over each expert's own tokens: offsets along T)

Numerics are the sequential experts' exactly: every expert's operands still come from the one operand
pipeline (``kernels.operand.gemm_operands``) with *its own* recipe and ``LayerQuantState`` -- per-tensor
amaxes over that expert's tokens, its own stochastic-rounding streams and amax histories, its own
telemetry -- so ``experts:`` rules, the plan names and the SQNR report are unchanged. Only the product
is grouped. A grouped call needs one recipe for all its experts: experts are grouped by identical
``(fc1 precision, fc2 precision, GEMM backend)``, one grouped fc1 and fc2 per group.

Which product runs, per GEMM and format (``gemm_path``; printed at start-up by ``describe_grouped_paths``):

=====================================  ==========================================================
path                                   when
=====================================  ==========================================================
``torch._grouped_mm``                  the GEMM's per-expert backend is ``bf16_mm`` (BF16 tensor
                                       cores: any ``Format.bf16_exact`` format, its FP32 tensor
                                       factors applied per expert after the product), or on a CPU
                                       a plain BF16 recipe (``emulated``): BF16 operands, FP32
                                       accumulation, one rounding (CPU: the same bits as the
                                       per-expert FP32 GEMM, tested)
``torch._scaled_grouped_mm``           per-tensor FP8 E4M3 x E4M3 on ``fp8_scaled_mm`` (CUDA sm_90+): each
                                       expert's decode scale as row-wise scales; BF16 output (a
                                       GEMM whose output is FP32 runs per expert)
per-expert loop                        everything else: the ``emulated`` / ``reference`` backends
                                       (MXFP4, NVFP4, FP8, ... on a CPU: the specification), the
                                       block-scaled ``mx_scaled_mm`` (torch 2.13 has no grouped
                                       MX/NVFP4 entry point we use)
=====================================  ==========================================================

The whole layer runs the per-expert loop (``SequentialMLP``'s forward) while a rollout plan packs the
expert weights, with ``--qat-backward ste`` and with ``fprop_x`` (rollout-guided QAT): those are
per-linear features of ``model.layers`` the grouped function does not take.
"""

from __future__ import annotations

import contextlib

import torch

from kernels.backends import capability_name, device_capability, select_backend
from kernels.cast_transpose import share_dy
from kernels.gemm import bf16_single_rounding, fp32_gemm, gemm, ieee_fp32_matmul
from kernels.operand import gemm_operands
from model.linear import _out_dtype
from model.moe import PaddedSequentialMLP, token_bucket
from precision.elements import E4M3
from precision.formats import Scaling
from precision.recipe import Gemm, GemmRecipe, LinearPrecision

__all__ = ["GROUPED_MM", "LOOP", "SCALED_GROUPED_MM", "GroupedSequentialMLP", "describe_grouped_paths",
           "gemm_path", "grouped_linear"]

GROUPED_MM = "torch._grouped_mm"
SCALED_GROUPED_MM = "torch._scaled_grouped_mm"
LOOP = "per-expert loop"


def _plain_bf16(recipe: GemmRecipe) -> bool:
    """Both operands unscaled and exactly BF16 (the ``bf16`` format): the BF16 form is the values."""
    return recipe.rotation == "none" and all(
        op.format.kind == Scaling.NONE and op.format.bf16_exact for op in (recipe.a, recipe.b))


def gemm_path(recipe: GemmRecipe, device, backend: str = "auto", g: Gemm = Gemm.FPROP) -> tuple[str, str]:
    """``(path, per-expert backend)`` of a grouped expert GEMM under ``recipe`` on ``device`` (a torch
    device or a capability, as ``kernels.backends``) with the layer's GEMM ``backend``."""
    cap = device_capability(device)
    chosen = select_backend(recipe, cap, backend, gemm=g)
    if (chosen == "fp8_scaled_mm" and isinstance(cap, tuple) and cap >= (9, 0) and hasattr(torch, "_scaled_grouped_mm")
            and recipe.a.format.element is E4M3 and recipe.b.format.element is E4M3):  # its kernels: E4M3 only
        return SCALED_GROUPED_MM, chosen
    if hasattr(torch, "_grouped_mm") and (chosen == "bf16_mm" or chosen == "emulated" and cap is None
                                          and _plain_bf16(recipe)):
        return GROUPED_MM, chosen
    return LOOP, chosen


# ============================================================================================
# The grouped products (operands from the pipeline, per expert)
# ============================================================================================


def _offsets(sizes: list[int], device) -> torch.Tensor:
    return torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)


def _stacked(g: Gemm, a: list[torch.Tensor], b: list[torch.Tensor]):
    """``(mat_a, mat_b, sizes)`` for torch's grouped entry points from per-expert operands in
    contraction-last form ``[rows, K]``: Fprop / Dgrad stack the weights (2-D x 3-D, ``sizes`` the
    experts' token rows), Wgrad concatenates along the tokens (2-D x 2-D, ``sizes`` along the
    contraction)."""
    if g is Gemm.WGRAD:  # a_e = dy_eᵀ [out, T_e], b_e = x_eᵀ [in, T_e]
        return torch.cat(a, dim=1), torch.cat(b, dim=1).t(), [t.shape[1] for t in a]
    return torch.cat(a, dim=0), torch.stack(b).transpose(-2, -1), [t.shape[0] for t in a]


def _split_out(g: Gemm, out: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(out.unbind(0)) if g is Gemm.WGRAD else list(out.split(sizes))


def _grouped_mm(g: Gemm, ops: list, out_dtype: torch.dtype) -> list[torch.Tensor]:
    """BF16 grouped GEMM of the experts' BF16 operand forms, FP32 accumulation; each expert's FP32
    tensor factors and SR pre-scale applied after the product, as ``kernels.bf16_mm`` does per GEMM."""
    mat_a, mat_b, sizes = _stacked(g, [o.a.bf16 for o in ops], [o.b.bf16 for o in ops])
    offs = _offsets(sizes, mat_a.device)
    factors = [(o.a.out_scale, o.b.out_scale, o.a.fmt.prescale_factor * o.b.fmt.prescale_factor) for o in ops]
    if (mat_a.is_cuda and out_dtype == torch.bfloat16
            and all(sa is None and sb is None and p == 1.0 for sa, sb, p in factors)):
        with bf16_single_rounding():  # cuBLAS writes BF16: one rounding of the FP32 accumulator
            return _split_out(g, torch._grouped_mm(mat_a, mat_b, offs=offs), sizes)
    if mat_a.is_cuda:
        out = torch._grouped_mm(mat_a, mat_b, offs=offs, out_dtype=torch.float32)
    else:  # CPU: the output dtype must be the operands', and a BF16 output is not always the FP32 sum
        # rounded once (K = 128: last-bit differences), so FP32 operands: BF16 x BF16 products are exact
        with ieee_fp32_matmul():
            out = torch._grouped_mm(mat_a.float(), mat_b.float(), offs=offs)
    results = []
    for part, (sa, sb, p) in zip(_split_out(g, out, sizes), factors, strict=True):
        scales = [s for s in (sa, sb) if s is not None]
        if len(scales) == 2:
            part = part * (scales[0] * scales[1])
        elif scales:
            part = part * scales[0]
        if p != 1.0:
            part = part / p
        results.append(part.to(out_dtype))
    return results


def _scaled_grouped_mm(g: Gemm, ops: list, out_dtype: torch.dtype) -> list[torch.Tensor]:
    """Per-tensor FP8 grouped GEMM: each expert's codes, its decode scales broadcast to row-wise
    scales (``scale_a`` per row of A, ``scale_b`` per column of B), BF16 output -- the per-tensor
    ``torch._scaled_mm`` product of each expert, grouped."""
    from kernels.scaled_mm import hw_operand

    hw = [(hw_operand(o.a, "tensor"), hw_operand(o.b, "tensor")) for o in ops]
    if any((h.rows, h.k) != (q.codes.shape[0], q.codes.shape[1] * (2 if q.packed else 1))
           for o, pair in zip(ops, hw) for q, h in zip((o.a, o.b), pair)):
        raise ValueError(f"{g.value}: grouped FP8 operands need rows and contraction in multiples of 32 (no padding "
                         "inside a group)")
    mat_a, mat_b, sizes = _stacked(g, [ha.data for ha, _ in hw], [hb.data for _, hb in hw])
    # one decode scale per row of each group's A and per column of its B: [sum rows] and [E, N]
    # (Wgrad, 2-D x 2-D: [E * N])
    scale_a = torch.cat([ha.scale.float().expand(ha.rows) for ha, _ in hw])
    scale_b = [hb.scale.float().expand(hb.rows) for _, hb in hw]
    scale_b = torch.cat(scale_b) if g is Gemm.WGRAD else torch.stack(scale_b)
    out = torch._scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=_offsets(sizes, mat_a.device),
                                   out_dtype=torch.bfloat16)
    return [part.to(out_dtype) for part in _split_out(g, out, sizes)]


def grouped_gemm(g: Gemm, pairs: list[tuple[torch.Tensor, torch.Tensor]], recipe: GemmRecipe, states: list,
                 backend: str, path: str, *, shared: list | None = None,
                 out_dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """GEMM ``g`` of every expert's operands ``(a_e, b_e)`` (natural layouts, ``kernels.gemm``) under
    ``recipe``, each quantized with its own state ``states[e]``, the products through ``path``; one
    result per expert, rounded once to ``out_dtype``."""
    shared = shared or [None] * len(pairs)
    if path == LOOP or (path == SCALED_GROUPED_MM and out_dtype != torch.bfloat16):
        return [gemm(g, a, b, recipe, backend, state=s, shared_dy=sd, out_dtype=out_dtype)
                for (a, b), s, sd in zip(pairs, states, shared, strict=True)]
    codes, bf16 = path == SCALED_GROUPED_MM, path == GROUPED_MM
    ops = [gemm_operands(g, a, b, recipe, s, codes=codes, bf16=bf16, shared_dy=sd)
           for (a, b), s, sd in zip(pairs, states, shared, strict=True)]
    if any(o.high_precision for o in ops):  # QAT warm-up: the BF16 GEMM every backend runs then
        return [fp32_gemm(g, o.a.values, o.b.values).to(out_dtype) for o in ops]
    if path == GROUPED_MM:
        return _grouped_mm(g, ops, out_dtype)
    return _scaled_grouped_mm(g, ops, out_dtype)


# ============================================================================================
# One autograd function, three labelled GEMM blocks
# ============================================================================================


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_hp, counts, precision: LinearPrecision, states, backend: str, paths, *weights):
        xs = x_hp.split(counts)
        # === FPROP: y_e = x_e @ w_e.T ===  [T_e, in] x [out, in] -> [T_e, out], all experts in one call
        ys = grouped_gemm(Gemm.FPROP, list(zip(xs, weights)), precision.fprop, states, backend, paths[Gemm.FPROP],
                          out_dtype=_out_dtype(x_hp.dtype))
        ctx.save_for_backward(x_hp, *weights)
        ctx.counts, ctx.precision, ctx.states, ctx.backend, ctx.paths = counts, precision, states, backend, paths
        return torch.cat(ys).to(x_hp.dtype)

    @staticmethod
    def backward(ctx, dy):
        x_hp, *weights = ctx.saved_tensors
        p, states, backend, paths = ctx.precision, ctx.states, ctx.backend, ctx.paths
        xs, dys = x_hp.split(ctx.counts), dy.split(ctx.counts)
        shared = [share_dy(d, p, s, backend) for d, s in zip(dys, states)]  # on CUDA: one read of each dy
        dx = None
        dws = [None] * len(weights)
        if ctx.needs_input_grad[0]:
            # === DGRAD: dx_e = dy_e @ w_e ===  [T_e, out] x [out, in] -> [T_e, in]
            dx = torch.cat(grouped_gemm(Gemm.DGRAD, list(zip(dys, weights)), p.dgrad, states, backend,
                                        paths[Gemm.DGRAD], shared=shared, out_dtype=_out_dtype(x_hp.dtype)))
            dx = dx.to(x_hp.dtype)
        if any(ctx.needs_input_grad[6:]):
            # === WGRAD: dw_e = dy_e.T @ x_e ===  [T_e, out] x [T_e, in] -> [out, in] (over each expert's tokens)
            dws = [dw.to(w.dtype) for dw, w in zip(
                grouped_gemm(Gemm.WGRAD, list(zip(dys, xs)), p.wgrad, states, backend, paths[Gemm.WGRAD],
                             shared=shared, out_dtype=_out_dtype(weights[0].dtype)), weights, strict=True)]
        return (dx, None, None, None, None, None, *dws)


def grouped_linear(x: torch.Tensor, counts: list[int], linears: list) -> torch.Tensor:
    """``y_e = x_e · w_eᵀ`` for each expert's policy linear in ``linears`` (one recipe and backend for
    all) on its ``counts[e]`` rows of ``x`` ``[sum(counts), in]``, as one grouped GEMM per GEMM."""
    first = linears[0]
    for lin in linears:
        lin.check_precision()
    precision, backend = first.precision, first.gemm_backend
    states = tuple(lin.quant_state for lin in linears)
    paths = {g: gemm_path(precision.recipe(g), x.device, backend, g)[0] for g in Gemm}
    with contextlib.ExitStack() as stack:
        for lin in linears:  # recomputation's call index, as each linear's own GEMM would take it
            stack.enter_context(lin.fprop_call_index())
        if not torch.is_grad_enabled():  # evaluation or generation: read the states, change nothing
            for s in states:
                if not s.frozen:
                    stack.enter_context(s.read_only())
        return _GroupedLinearFn.apply(x, tuple(counts), precision, states, backend, paths,
                                      *(lin.weight for lin in linears))


# ============================================================================================
# The module
# ============================================================================================


class GroupedSequentialMLP(PaddedSequentialMLP):
    """``PaddedSequentialMLP`` (same experts, parameters, names and checkpoints) whose forward runs each
    group of identically-planned experts' fc1 and fc2 as one grouped policy GEMM (module docstring).
    Tokens are padded per expert as the sequential experts pad them (``token_bucket``), so the results
    are theirs and every expert -- one that got no token too -- gets a (zero) gradient each step."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if self.config.moe_apply_probs_on_input:
            raise ValueError("GroupedSequentialMLP: moe_apply_probs_on_input is not supported")
        if self.config.bias_activation_fusion or getattr(self.config, "use_te_activation_func", False):
            raise ValueError("--moe-grouped-gemm: fused bias-activation is not supported (policy experts use "
                             "megatron's unfused activation)")
        experts = list(self.local_experts)
        if any(lin.rollout_weight is not None or lin.fprop_x is not None or lin.backward_operands != "hp"
               for e in experts for lin in (e.linear_fc1, e.linear_fc2)):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        counts = tokens_per_expert.tolist()
        tokens = torch.split(permuted_local_hidden_states, counts)
        probs = torch.split(permuted_probs, counts)
        groups: dict[tuple, list[int]] = {}
        for i, e in enumerate(experts):
            key = (e.linear_fc1.precision, e.linear_fc2.precision, e.linear_fc1.gemm_backend, e.linear_fc2.gemm_backend)
            groups.setdefault(key, []).append(i)
        outputs: list[torch.Tensor | None] = [None] * len(experts)
        for members in groups.values():
            for i, out in zip(members, self._group_forward([experts[i] for i in members],
                                                           [tokens[i] for i in members],
                                                           [probs[i] for i in members]), strict=True):
                outputs[i] = out
        return torch.cat(outputs, dim=0), None

    @staticmethod
    def _group_forward(experts: list, tokens: list[torch.Tensor], probs: list[torch.Tensor]) -> list[torch.Tensor]:
        ns = [t.shape[0] for t in tokens]
        rows = [token_bucket(n) for n in ns]
        pad = torch.nn.functional.pad
        x = torch.cat([pad(t, (0, 0, 0, r - n)) for t, n, r in zip(tokens, ns, rows)])
        scale = torch.cat([pad(p, (0, r - n)) for p, n, r in zip(probs, ns, rows)])
        h = grouped_linear(x, rows, [e.linear_fc1 for e in experts])
        h = _expert_activation(experts, h, rows, scale)
        y = grouped_linear(h, rows, [e.linear_fc2 for e in experts])
        outs = []
        for e, y_e, s_e, n in zip(experts, y.split(rows), scale.split(rows), ns, strict=True):
            fc2_bias = e.linear_fc2.bias if e.linear_fc2.skip_bias_add else None
            if fc2_bias is not None:  # megatron's expert MLP adds the bias scaled by the token's probability
                y_e = y_e + fc2_bias.unsqueeze(0) * s_e.unsqueeze(-1)
            outs.append(y_e[:n])
        return outs


def _expert_activation(experts: list, h: torch.Tensor, rows: list[int], scale: torch.Tensor) -> torch.Tensor:
    """Megatron ``MLP.forward``'s unfused activation between fc1 and fc2 (fc1's bias, GLU with its clamp
    and offset, the per-token probability scale), on all experts' rows at once: elementwise, so each
    row gets exactly what the expert's own MLP computes; biases are added per expert."""
    config, act = experts[0].config, experts[0].activation_func
    if any(e.linear_fc1.bias is not None and e.linear_fc1.skip_bias_add for e in experts):
        h = torch.cat([h_e + e.linear_fc1.bias if e.linear_fc1.skip_bias_add and e.linear_fc1.bias is not None else h_e
                       for e, h_e in zip(experts, h.split(rows), strict=True)])
    if config.gated_linear_unit:
        x_glu, x_linear = torch.chunk(h, 2, dim=-1)
        if (val := config.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        h = config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)
    else:
        h = act(h)
    dtype = h.dtype
    return (h * scale.unsqueeze(-1)).to(dtype)


# ============================================================================================
# What runs where: the start-up report
# ============================================================================================


def _pair(recipe: GemmRecipe) -> str:
    a, b = recipe.a.fmt, recipe.b.fmt
    return a if a == b else f"{a} x {b}"


def describe_grouped_paths(plan, device, requested: str = "auto") -> str:
    """Per GEMM, which path each format pair of the plan's routed experts takes under
    ``--moe-grouped-gemm`` (grouped kernel or per-expert loop, with the per-expert backend): the
    lines a run prints after the GEMM-backend table. Empty when the plan has no routed expert."""
    experts = {n: p for n, p in dict(plan).items() if ".mlp.experts.local_experts." in n}
    if not experts:
        return ""
    cap = device_capability(device)
    lines = [f"Grouped expert GEMMs (--moe-grouped-gemm) on {capability_name(cap)}:"]
    for g in Gemm:
        seen: dict[str, str] = {}
        for prec in experts.values():
            r = prec.recipe(g)
            path, backend = gemm_path(r, cap, requested, g)
            note = " (BF16 outputs; FP32 outputs per expert)" if path == SCALED_GROUPED_MM else ""
            seen.setdefault(_pair(r), f"{path}{note}, operands {backend}")
        lines.append(f"  {g.value}: " + "; ".join(f"{pair} -> {what}" for pair, what in seen.items()))
    return "\n".join(lines)
