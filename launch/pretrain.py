"""Pretrain a megatron-core GPT under a per-GEMM precision policy (Megatron-LM flag names).

    torchrun --nproc-per-node 2 launch/pretrain.py --model-size tiny --precision wgrad_hadamard \\
        --tensor-model-parallel-size 2 --train-iters 200 --save runs/tiny/checkpoints --save-interval 100 \\
        --tensorboard-dir runs/tiny/tb
    python launch/pretrain.py --help            # every flag; a world of one runs without torchrun

Exit status of every rank (``pretrain/status.py``), each failure one line on stderr,
``pretrain.py: error: ...``, printed once under torchrun (which itself exits 1 if any rank fails):
0 done or stopped cleanly; 2 bad input (a flag, a file, a corrupt checkpoint); 3 diverged (a
non-finite loss or gradient norm; ``--save/run_status.json`` names the iteration and the last good
checkpoint); 4 a checkpoint could not be written (e.g. a full disk; the previous one is intact).
SIGTERM: the current iteration finishes, a checkpoint is saved (with ``--save``) and the exit
status is 0. The loop itself lives in ``pretrain/train.py``.
"""

import sys

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401
from pretrain import runtime

runtime.start("pretrain.py")  # before megatron is imported: its expected warnings; end with torchrun

from pretrain.train import main

if __name__ == "__main__":
    sys.exit(main())
