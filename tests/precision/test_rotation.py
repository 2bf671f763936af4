"""Hadamard rotations: construction, orthogonality, exact-product invariance."""

import pytest
import torch

from precision.rotation import hadamard_matrix, random_signs, rotate


@pytest.mark.parametrize("n", [2, 4, 16, 32])
def test_hadamard_orthogonal_and_sylvester(n):
    h = hadamard_matrix(n).double()
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-6, rtol=0)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    k = torch.ones(1, 1, dtype=torch.float64)
    while k.shape[0] < n:
        k = torch.kron(k, h2)
    torch.testing.assert_close(h, k / n**0.5, atol=1e-7, rtol=0)


def test_h16_is_exact_quarter_signs():
    h = hadamard_matrix(16)
    assert set(h.abs().unique().tolist()) == {0.25}


@pytest.mark.parametrize("signs", [False, True])
def test_rotating_both_operands_preserves_the_product(signs):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 48, generator=g, dtype=torch.float64).float()
    b = torch.randn(32, 48, generator=g, dtype=torch.float64).float()
    s = random_signs(16, g) if signs else None
    ra, rb = rotate(a, 1, 16, s), rotate(b, 1, 16, s)
    torch.testing.assert_close(ra @ rb.T, a @ b.T, atol=1e-4, rtol=1e-5)
    # along axis 0 (Wgrad's token axis)
    c = torch.randn(48, 8, generator=g)
    torch.testing.assert_close(rotate(c, 0, 16, s).T @ rotate(c, 0, 16, s), c.T @ c, atol=1e-4, rtol=1e-5)


def test_rotation_spreads_an_outlier():
    x = torch.zeros(1, 16)
    x[0, 3] = 16.0
    r = rotate(x, 1, 16)
    assert torch.all(r.abs() == 4.0)


@pytest.mark.parametrize("n", [16, 32])
@pytest.mark.parametrize("axis", [0, 1])
def test_fast_transform_equals_the_matrix_product(n, axis):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 64, generator=g)
    s = random_signs(n, g)
    q = (s.unsqueeze(1) * hadamard_matrix(n)).double()
    xm = x.double().movedim(axis, -1)
    ref = (xm.reshape(-1, n) @ q).reshape(xm.shape).movedim(-1, axis)
    torch.testing.assert_close(rotate(x, axis, n, s).double(), ref, atol=1e-5, rtol=1e-6)
