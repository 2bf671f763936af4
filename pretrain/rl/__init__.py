"""RL post-training with FP4 rollouts (``launch/rl.py``).

One iteration is rollout -> score -> update on pretraining's skeleton: ``trainer`` (the loop, on
``pretrain.runtime.run``; its state, evaluation, logging), ``rollout`` (the engine under the rollout
plan, its samples and memory, the automatic ``fallback``), ``score`` (rewards, advantages, the
trainer's log-probs of the distribution the engine sampled from, the mismatch and the rollout
correction), ``update`` (the PPO passes; each optimizer step is ``pretrain.engine``'s), ``checkpoint``
(save, exact resume, ``rl_summary.json``). The numerics: ``objective`` (verl's advantages, losses,
aggregation, corrections and their metrics), ``qat`` (rollout-guided QAT), ``mismatch`` (verl's
mismatch metrics) and their ``attribution`` to weights / activations / KV-cache, ``alignment``;
flags in ``arguments`` (typed ``RLConfig``, with pretraining's ``RunConfig``), tasks in ``task``,
an RL sweep's results in ``sweep_results`` (beside the pretraining sweep's ``pretrain.sweep.results``)."""
