"""``kernels.gemm.ieee_fp32_matmul`` under every way a user may have set TF32 before it.

torch has a legacy TF32 API (``torch.backends.cuda.matmul.allow_tf32``,
``torch.set_float32_matmul_precision``) and a new one (``fp32_precision`` per backend); a cuBLAS
FP32 GEMM reads the flag through the legacy view (``allow_tf32``) and raises "mix of the legacy and
new APIs" when the two disagree. Reading the flags is enough to see it on a CPU.
"""

import pytest
import torch

from kernels.gemm import ieee_fp32_matmul

MATMUL = torch.backends.cuda.matmul
MKLDNN = torch.backends.mkldnn.matmul


def _read(getter):
    try:
        return getter()
    except RuntimeError as e:
        return f"refused: {str(e)[:40]}"


def _flags() -> dict:
    """Every view of the TF32 state; a view torch refuses to read is recorded as refused."""
    return {"allow_tf32": _read(lambda: MATMUL.allow_tf32),
            "float32_matmul_precision": _read(torch.get_float32_matmul_precision),
            "cuda.matmul": MATMUL.fp32_precision, "mkldnn.matmul": MKLDNN.fp32_precision,
            "generic": torch.backends.fp32_precision}


USER_SETTINGS = {
    "untouched": lambda: None,
    "legacy allow_tf32": lambda: setattr(MATMUL, "allow_tf32", True),
    "legacy precision high": lambda: torch.set_float32_matmul_precision("high"),
    "legacy precision medium": lambda: torch.set_float32_matmul_precision("medium"),
    "new cuda tf32": lambda: setattr(MATMUL, "fp32_precision", "tf32"),
    "new cuda ieee": lambda: setattr(MATMUL, "fp32_precision", "ieee"),
    "new generic tf32": lambda: setattr(torch.backends, "fp32_precision", "tf32"),
}


@pytest.fixture
def restore_defaults():
    yield
    torch.backends.fp32_precision = "none"
    MATMUL.fp32_precision = "none"
    MKLDNN.fp32_precision = "none"
    torch.set_float32_matmul_precision("highest")
    assert MATMUL.allow_tf32 is False


@pytest.mark.parametrize("setting", list(USER_SETTINGS))
def test_ieee_fp32_matmul_never_mixes_the_legacy_and_new_tf32_apis(setting, restore_defaults):
    USER_SETTINGS[setting]()
    before = _flags()
    with ieee_fp32_matmul():
        # what cuBLAS reads before an FP32 GEMM: must be readable (no "mix" error) and off
        assert MATMUL.allow_tf32 is False
        assert MATMUL.fp32_precision in ("ieee", "none")  # "none": the legacy flag's "highest" rules
        assert MKLDNN.fp32_precision in ("ieee", "none")
        assert torch.get_float32_matmul_precision() == "highest"
    assert _flags() == before, "the user's TF32 setting was not restored"
