"""Pretraining, evaluation and RL post-training of the policy-routed GPT (``launch/`` holds the entry points).

Orchestration, top to bottom:

``config/``        typed run configs: one frozen dataclass per group of flags (``RunConfig``); the
                   parser is generated from them; the flags <-> ``model.gpt.ModelConfig`` mapping
``arguments``      the command line's glue: model-size files, ``--pretrained-checkpoint``'s shape,
                   derived defaults, one-line validation; ``parse_run_config`` returns a ``RunConfig``
``runtime``        the process around a loop: process groups, SIGTERM, refusals -> exit codes,
                   rank-0 printing (``run``), expected warnings, the launcher watch
``train``          the ``Trainer`` and the pretraining loop on ``trainer/``'s components (plans,
                   precision phases, metrics, validator, checkpointer), each owning its cadence
``engine``         forward/backward over the micro-batches and one ``optimizer_step`` (gradient
                   reduction, clipping, lr, the non-finite rollback), shared with RL
``optim``          AdamW, the lr / weight-decay schedule, FP32 main parameters, clipping
``checkpointing``  Megatron-layout checkpoints, atomic and checksummed (``checkpoint_files``: the
                   layout's names, checksums, ``run_config.json`` and the tokenizer copy); ``reshard``
``data/``, ``evaluation/``, ``rl/``, ``sweep/``, ``plan_search``, ``hf_convert`` / ``hf_export``,
``pretrained``, ``status``: datasets, evaluation, RL post-training, sweeps, plan search, Hugging Face
conversion, initial weights, exit statuses.
"""
