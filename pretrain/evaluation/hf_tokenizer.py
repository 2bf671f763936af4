"""``HFTokenizer`` now lives in ``pretrain.data.hf_tokenizer`` (data owns the tokenizers).

This module keeps the old import working; its errors name ``launch/evaluate.py``'s ``--hf-tokenizer``.
"""

from __future__ import annotations

from pretrain.data.hf_tokenizer import HFTokenizer as _HFTokenizer

__all__ = ["HFTokenizer"]


class HFTokenizer(_HFTokenizer):
    """``pretrain.data.HFTokenizer`` whose errors name ``--hf-tokenizer`` (launch/evaluate.py's flag)."""

    def __init__(self, path: str, flag: str = "--hf-tokenizer"):
        super().__init__(path, flag)
