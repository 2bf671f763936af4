"""Hadamard rotations applied to both operands of a GEMM along its contraction axis.

Consecutive groups of ``n`` elements along the contraction axis are multiplied by the same
orthogonal matrix ``Q``; because ``Q Qᵀ = I`` the exact product is unchanged, while outliers are
spread over the group before quantization.

* ``had16`` / ``had32``: ``Q = H_n``, the normalized Sylvester Hadamard matrix
  (``H16 = H2⊗H2⊗H2⊗H2 / 4``, ``H2 = [[1,1],[1,-1]]``) -- deterministic, identical every step.
  This is the MXFP4 pretraining study's fix for Wgrad (arXiv 2605.09825).
* ``rht16``: ``Q = diag(s)·H16`` with random signs ``s`` fixed per layer (from a seed).
* ``rht16_resample``: new random signs on every call, drawn from a seeded generator.
* ``rht128`` / ``rht128_resample``: the same with 128-point groups -- Quartet II's randomized
  Hadamard (its backward rotates 128 elements at a time), the group of ``nvfp4/eden128``
  (``precision.eden``). The product needs whole groups: both operands are zero-padded along the
  contraction axis to a multiple of 128 (``kernels.operand.pad_and_rotation``).
* ``rht16_te``: ``Q = diag(s)·H16`` with TransformerEngine's fixed sign vector (:data:`TE_SIGNS`,
  the constant its NVFP4 recipe applies to both Wgrad operands): the same signs in every layer
  and every step, so a row vector ``x`` becomes ``x·diag(s)·H16`` as in TE's reference.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["ROTATIONS", "TE_SIGNS", "fixed_signs", "hadamard_matrix", "random_signs", "rotate", "rotation_size"]

ROTATIONS = ("none", "had16", "had32", "rht16", "rht16_resample", "rht16_te", "rht128", "rht128_resample")
# TransformerEngine's NVFP4 Wgrad sign vector (its ``get_wgrad_sign_vector``; as a bit mask with
# bit i set where s_i = -1: 0xD7E8)
TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def rotation_size(rotation: str) -> int:
    if rotation not in ROTATIONS:
        raise ValueError(f"unknown rotation {rotation!r}; valid: {', '.join(ROTATIONS)}")
    return {"none": 1, "had16": 16, "had32": 32, "rht16": 16, "rht16_resample": 16, "rht16_te": 16,
            "rht128": 128, "rht128_resample": 128}[rotation]


def fixed_signs(rotation: str, device=None) -> torch.Tensor | None:
    """The constant sign vector of a rotation that has one (``rht16_te``), float32; else None. Made
    once per device (a host-to-device copy once, not on every call); callers must not write to it."""
    if rotation == "rht16_te":
        return _te_signs(torch.device(device) if device is not None else torch.device("cpu"))
    return None


@functools.cache
def _te_signs(device: torch.device) -> torch.Tensor:
    return torch.tensor(TE_SIGNS, dtype=torch.float32, device=device)


@functools.cache
def _hadamard_cpu(n: int) -> torch.Tensor:
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(h2, h)
    return (h / n**0.5).float()  # entries +-1/sqrt(n): exact in float32 for n = 4^k, and 1/sqrt(32) rounded


def hadamard_matrix(n: int, device=None) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix of size ``n`` (float32), made once per device; callers
    must not write to it."""
    return _hadamard_on(n, torch.device(device) if device is not None else torch.device("cpu"))


@functools.cache
def _hadamard_on(n: int, device: torch.device) -> torch.Tensor:
    return _hadamard_cpu(n).to(device)


def random_signs(n: int, generator: torch.Generator | None, device=None) -> torch.Tensor:
    """``n`` random +-1 values (float32) from ``generator``."""
    bits = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int64)
    return (1.0 - 2.0 * bits.float()).to(device)


def rotate(x: torch.Tensor, axis: int, n: int, signs: torch.Tensor | None = None) -> torch.Tensor:
    """Multiply consecutive groups of ``n`` along ``axis`` by ``diag(signs)·H_n`` (float32).

    Computed as a fast Walsh-Hadamard transform -- log2(n) butterfly stages ``(a, b) -> (a+b, a-b)``
    in a fixed order, then one multiplication by ``1/sqrt(n)`` -- which equals the product with the
    Sylvester matrix and fixes the FP32 summation order, so the fused (compiled) quantizer that
    repeats this expression reproduces it bit for bit. No transposed copy: the groups are views.

    The length of ``axis`` must be a multiple of ``n`` (callers zero-pad both operands first:
    zeros contribute nothing to the product).
    """
    axis = axis % x.dim()
    length = x.shape[axis]
    if length % n:
        raise ValueError(f"rotate: axis length {length} is not a multiple of the rotation size {n}")
    if n & (n - 1) or n < 1:
        raise ValueError(f"rotate: size must be a power of two, got {n}")
    y = x.float()
    if signs is not None:
        shape = [1] * (y.dim() + 1)
        shape[axis + 1] = n
        y = (y.unflatten(axis, (length // n, n)) * signs.to(y.device).reshape(shape)).flatten(axis, axis + 1)
    h = n // 2
    while h >= 1:
        g = y.unflatten(axis, (length // (2 * h), 2, h))
        a, b = g.select(axis + 1, 0), g.select(axis + 1, 1)
        y = torch.stack([a + b, a - b], dim=axis + 1).flatten(axis, axis + 2)
        h //= 2
    return y * (1.0 / n**0.5)
