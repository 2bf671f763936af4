"""RL post-training with FP4 rollouts: trainer/rollout mismatch metrics (``mismatch``) and their
attribution to weights / activations / KV-cache (``attribution``)."""
