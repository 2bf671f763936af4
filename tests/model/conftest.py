import socket

import pytest
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp1():
    """torch.distributed (gloo, world size 1) and megatron parallel_state with TP=1, torn down after."""
    from megatron.core import parallel_state

    owns_pg = not torch.distributed.is_initialized()
    if owns_pg:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    yield
    parallel_state.destroy_model_parallel()
    if owns_pg:
        torch.distributed.destroy_process_group()


@pytest.fixture
def reference_linear(monkeypatch):
    """Route every policy linear through F.linear (recording the recipes it is handed)."""
    import model.layers

    from ._fakes import ReferenceLinear

    ref = ReferenceLinear()
    monkeypatch.setattr(model.layers, "policy_linear", ref)
    return ref
