"""Fixtures shared by every test package."""

from pathlib import Path

import pytest
import torch

from tests._dist import free_port


@pytest.fixture(scope="module")
def world_of_one():
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


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """The built-in corpus (the CLI's default settings), built once for all runs of the session."""
    from pretrain.data import build_default_data

    path = tmp_path_factory.mktemp("pretrain_data_cache")
    build_default_data(str(path))
    return path
