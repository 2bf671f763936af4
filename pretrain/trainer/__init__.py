"""The trainer skeleton's components, each owning its cadence (``pretrain.train`` holds the loop).

``plans``         the run's precision plans, resolved once; the model built with them
                  (``build_scheduled_model``, ``SchedulePlans``, ``--amax-*`` / ``--fp8-margin``)
``phases``        ``PrecisionPhases``: ``maybe_switch_phase(step)`` between schedule phases;
                  ``begin_step`` / ``end_step``: the layers' numerics and delayed-scaling telemetry
``metrics``       ``MetricsLogger``: progress lines and TensorBoard; ``record`` each step,
                  ``maybe_log(step)`` settles them (one host read per window; divergence found there)
``validator``     ``Validator``: ``maybe_validate(step)``, held-out loss with its standard error
``checkpointer``  ``Checkpointer``: ``maybe_save(step)``, ``load`` (resume / ``--finetune``),
                  ``load_pretrained``

The optimizer step itself is the engine's (``pretrain.engine``: ``optimizer_step``), the process
around the loop ``pretrain.runtime`` (``run``), the configuration ``pretrain.config``.
"""
