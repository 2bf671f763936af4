"""Counter-based uniforms for stochastic rounding: a pure function of (key, global element index).

A stochastic-rounding quantizer needs one uniform ``u`` in [0, 1) per element. Drawing them from a
stateful generator ties the numbers to the local tensor's shape, so a tensor-parallel shard would
draw the same numbers as every other shard. Here the uniform of an element is a hash of its
*global* position instead::

    index = (row_offset + r) * global_cols + (col_offset + c)      # (r, c): local 2-D position
    u     = (hash(seed, index) >> 8) * 2^-24                        # 24 bits: exact in float32

``(r, c)`` is the element's position in the tensor's natural layout viewed as 2-D
(``[prod(shape[:-1]), shape[-1]]``), before any padding; ``global_cols`` defaults to the local
column count. A shard that says where it sits in the whole tensor (``row_offset``, ``col_offset``,
``global_cols``) draws exactly the numbers the whole tensor draws for its elements, whatever axis
the quantizer's blocks run along.

The hash is four 32-bit words through Chris Wellons' ``lowbias32`` integer mixer::

    k_a = mix(seed_lo ^ mix(seed_hi ^ 0x9E3779B9))      # per key (host side, Python ints)
    k_b = mix(k_a ^ seed_hi ^ 0x85EBCA6B)
    h   = mix(mix(index_lo ^ k_a) ^ index_hi ^ k_b)     # per element

It costs two mixes (four multiplies) per element in Triton's uint32 arithmetic; the torch
reference computes the same bits with int64 tensors (multiplications split into 16-bit halves so
nothing overflows), which is also what ``kernels.fused`` compiles. ``kernels.triton_quant`` has the
same function in-kernel (no uniform tensor is read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SRKey", "mix32", "hash_uniforms", "MASK32"]

MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B  # lowbias32 multipliers
_GOLDEN, _SALT = 0x9E3779B9, 0x85EBCA6B


def _mix_int(x: int) -> int:
    """lowbias32 on a Python int (the per-key part, computed on the host)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    x ^= x >> 16
    return x


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2^32`` for int64 ``x`` in [0, 2^32): 16-bit halves of ``c``, no int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int64 tensor holding uint32 values (result in [0, 2^32))."""
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def hash_uniforms(index: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1) for int64 global element indices; ``keys``: int64 ``[k_a, k_b]``
    (``SRKey.keys()``; a tensor so that ``torch.compile`` does not bake them in)."""
    ka, kb = keys[0], keys[1]
    h = mix32((index & MASK32) ^ ka)
    h = mix32(h ^ (index >> 32) ^ kb)
    return (h >> 8).to(torch.float32) * (2.0**-24)


@dataclass(frozen=True)
class SRKey:
    """Where a tensor's stochastic-rounding uniforms come from.

    ``seed``: a 63-bit integer the caller derives from (seed, layer, GEMM, operand, call).
    ``row_offset`` / ``col_offset``: this tensor's position in the whole (unsharded) tensor, viewed
    as 2-D. ``global_cols``: the whole tensor's column count (``None``: this tensor's own).
    """

    seed: int
    row_offset: int = 0
    col_offset: int = 0
    global_cols: int | None = None

    def __post_init__(self):
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"SRKey: seed must be in [0, 2^63), got {self.seed}")
        if self.row_offset < 0 or self.col_offset < 0:
            raise ValueError(f"SRKey: offsets must be >= 0, got ({self.row_offset}, {self.col_offset})")
        if self.global_cols is not None and self.global_cols < 1:
            raise ValueError(f"SRKey: global_cols must be >= 1, got {self.global_cols}")

    def key_words(self) -> tuple[int, int]:
        """The per-key words ``(k_a, k_b)`` of the hash (module docstring)."""
        lo, hi = self.seed & MASK32, (self.seed >> 32) & MASK32
        ka = _mix_int(lo ^ _mix_int(hi ^ _GOLDEN))
        kb = _mix_int(ka ^ hi ^ _SALT)
        return ka, kb

    def cols(self, shape) -> int:
        """The column count of the global index: ``global_cols`` or the local last dimension."""
        return self.global_cols if self.global_cols is not None else (int(shape[-1]) if len(shape) else 1)

    def params(self, shape, device=None) -> torch.Tensor:
        """int64 ``[k_a, k_b, row_offset, col_offset, global_cols]`` (what the kernels take)."""
        ka, kb = self.key_words()
        return torch.tensor([ka, kb, self.row_offset, self.col_offset, self.cols(shape)],
                            dtype=torch.int64, device=device)

    def uniforms(self, shape, device=None) -> torch.Tensor:
        """float32 uniforms shaped ``shape`` (the torch reference)."""
        return uniforms_from_params(tuple(shape), self.params(shape, device))


def uniforms_from_params(shape: tuple, params: torch.Tensor) -> torch.Tensor:
    """``SRKey.uniforms`` from its ``params`` tensor: traceable by ``torch.compile`` (shapes static,
    keys and offsets tensors)."""
    cols = shape[-1] if len(shape) else 1
    rows = 1
    for s in shape[:-1]:
        rows *= s
    dev = params.device
    r = torch.arange(rows, dtype=torch.int64, device=dev).unsqueeze(1)
    c = torch.arange(cols, dtype=torch.int64, device=dev).unsqueeze(0)
    index = (params[2] + r) * params[4] + (params[3] + c)
    return hash_uniforms(index, params[:2]).reshape(shape)
