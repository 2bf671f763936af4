"""RL post-training (GRPO) of a starting policy with rollouts under their own precision.

    torchrun --nproc-per-node 2 launch/rl.py --load SFT_CKPT --task configs/rl/arith.yaml \\
        --precision wgrad_hadamard --rollout-precision mxfp4 --rollout-correction tis \\
        --rl-iters 100 --save runs/rl --tensorboard-dir runs/rl/tb
    python launch/rl.py --help            # every flag; a world of one runs without torchrun

``--load``: a pretraining checkpoint (weights only, RL iteration 0) or one this script wrote
(exact resume); a ``--save`` that already holds an RL checkpoint is resumed from. Exit status of
every rank (``pretrain/status.py``), each failure one line on stderr, ``rl.py: error: ...``:
0 done or stopped cleanly (SIGTERM: the iteration finishes, a checkpoint is saved); 2 bad input;
3 diverged (a non-finite step beyond --skip-nonfinite-steps); 4 a checkpoint could not be written.
At the end ``--save/rl_summary.json`` holds the run's results. The loop lives in
``pretrain/rl/trainer.py`` (rollout.py, score.py, update.py, checkpoint.py beside it), the flags in
``pretrain/rl/arguments.py``.
"""

import sys

if not __package__:  # run as a script: the repository root first on sys.path (launch/_paths.py)
    import _paths  # noqa: F401
from pretrain import runtime

runtime.start("rl.py")  # before megatron is imported: its expected warnings; end with torchrun

from pretrain.rl.trainer import main

if __name__ == "__main__":
    sys.exit(main())
