"""pretrain.runtime.run: any program's life (parse, agree, refuse, run) under its own name.

Its own module: runtime.run creates and tears down the default process group itself, so these
tests must not share a module with a module-scoped world (``world_of_one``) that they would end.
"""

from __future__ import annotations

import signal

import pytest
import torch

from pretrain import runtime


@pytest.fixture
def world_env(monkeypatch):
    """A world of one without torchrun; SIGTERM's handler and the groups restored after."""
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    runtime.reset_groups()


def test_run_refuses_bad_input_in_one_line_under_the_programs_name(world_env, capsys):
    from pretrain.arguments import ConfigError

    def parse(world, cuda):
        raise ConfigError("--foo 3: must be 1 or 2")

    with pytest.raises(SystemExit) as e:
        runtime.run(lambda config, signals: 0, prog="other.py", parse=parse)
    assert e.value.code == 2 and capsys.readouterr().err == "other.py: error: --foo 3: must be 1 or 2\n"


def test_run_maps_a_failed_save_to_exit_4_and_returns_the_programs_status(world_env, capsys):
    from pretrain.checkpointing import CheckpointSaveError

    def fails(config, signals):
        runtime.init_process_group()
        raise CheckpointSaveError("--save d: iteration 2 was not written (no space left on device)")

    with pytest.raises(SystemExit) as e:
        runtime.run(fails, prog="other.py", parse=lambda world, cuda: {"world": world})
    assert e.value.code == 4 and capsys.readouterr().err.startswith("other.py: error: --save d: iteration 2")
    torch.distributed.destroy_process_group()
    runtime.reset_groups()

    seen = {}

    def works(config, signals):
        runtime.init_process_group()
        seen.update(config=config, stop=signals.any_rank())
        return 3

    assert runtime.run(works, prog="other.py", parse=lambda world, cuda: {"world": world}) == 3
    assert seen == {"config": {"world": 1}, "stop": False} and not torch.distributed.is_initialized()
