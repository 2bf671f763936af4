"""RL post-training with FP4 rollouts: trainer/rollout mismatch metrics (``mismatch``) and their
attribution to weights / activations / KV-cache (``attribution``), and an RL sweep's results
(``sweep_results``, beside the pretraining sweep's ``pretrain.sweep.results``)."""
