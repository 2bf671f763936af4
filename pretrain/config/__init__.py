"""Typed run configuration: frozen dataclasses, one per group of flags, from which the parser is built.

    run = parse_run_config(argv, world_size, cuda)     # pretrain.arguments: parse, validate, freeze
    run.training.lr, run.parallel.tensor_model_parallel_size, run.checkpoint.save, ...
    run.model_config(vocab_size)                       # model.gpt.ModelConfig

``fields``  ``arg(...)``: a dataclass field that is a flag (names, argparse keywords, ``--help``
            text); ``add_group`` generates an argparse group from config classes; ``from_namespace``
            freezes a validated Namespace into a config.
``model``   ``ModelArgs`` (the model flags) and the one mapping to and from ``model.gpt.ModelConfig``
            (``model_config``, ``shape_of``, ``SHAPE_FLAGS``); the model-size files.
``run``     ``PrecisionRunConfig``, ``MemoryConfig``, ``ParallelConfig``, ``TrainingConfig``,
            ``DataConfig``, ``CheckpointConfig``, ``LoggingConfig``, their ``GROUPS`` (``--help``
            order) and ``RunConfig`` of them all.

Parsing and validation (model-size files, ``--pretrained-checkpoint``, one-line errors) stay in
``pretrain.arguments``; RL adds its own group (``pretrain.rl.arguments.RLConfig``).
"""

from pretrain.config.fields import add_group, arg, flag_name, from_namespace, to_flat_dict
from pretrain.config.model import (
    MODEL_SIZES_DIR,
    SHAPE_FLAGS,
    SHAPE_FROM_CONFIG,
    ModelArgs,
    model_config,
    model_sizes,
    shape_of,
)
from pretrain.config.run import (
    GROUPS,
    LR_DECAY_STYLES,
    LR_WSD_DECAY_STYLES,
    WD_INCR_STYLES,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    MemoryConfig,
    ParallelConfig,
    PrecisionRunConfig,
    RunConfig,
    TrainingConfig,
)

__all__ = [
    "GROUPS", "LR_DECAY_STYLES", "LR_WSD_DECAY_STYLES", "MODEL_SIZES_DIR", "SHAPE_FLAGS", "SHAPE_FROM_CONFIG",
    "WD_INCR_STYLES", "CheckpointConfig", "DataConfig", "LoggingConfig", "MemoryConfig", "ModelArgs",
    "ParallelConfig", "PrecisionRunConfig", "RunConfig", "TrainingConfig", "add_group", "arg", "flag_name",
    "from_namespace", "model_config", "model_sizes", "shape_of", "to_flat_dict",
]  # fmt: skip
