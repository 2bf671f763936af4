"""Pretrain a megatron-core GPT under a per-GEMM precision policy (Megatron-LM flag names).

    torchrun --nproc-per-node 2 launch/pretrain.py --model-size tiny --precision wgrad_hadamard \\
        --tensor-model-parallel-size 2 --train-iters 200 --save runs/tiny/checkpoints --save-interval 100 \\
        --tensorboard-dir runs/tiny/tb
    python launch/pretrain.py --help            # every flag; a world of one runs without torchrun

Bad input exits with status 2 and one line on stderr, ``pretrain.py: error: <flag>: ...``.
SIGTERM: the current iteration finishes, a checkpoint is saved (with ``--save``) and the exit
status is 0. The loop itself lives in ``pretrain/train.py``.
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# megatron-core's UserWarnings (TransformerEngine / Apex absent, deprecated config fields) are
# about features this entry point does not use.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

from pretrain.train import main

if __name__ == "__main__":
    sys.exit(main())
