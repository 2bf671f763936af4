"""megatron-core GPT with every linear layer's GEMMs routed through the precision policy.

linear.py     ``policy_linear``: the autograd function running Fprop / Dgrad / Wgrad per recipe
layers.py     ``PolicyColumnParallelLinear`` / ``PolicyRowParallelLinear``: megatron's TP linears
              with the local GEMM replaced by ``policy_linear``
attention.py  ``SDPAttention``: CPU- and GPU-capable core attention
spec.py       ``PolicySpecProvider`` and the GPT layer / block specs
gpt.py        ``ModelConfig``, ``build_gpt``, ``apply_precision_plan``, ``validate_config``
generate.py   ``Engine``: the one generation engine (prefill + KV-cache decode, sampling, re-scoring)
kv_cache.py   ``KVFormat``, ``KVCache``: keys and values stored quantized along the head dimension
rollout_plan.py  ``--rollout-precision``: Fprop weight/activation formats per linear, the KV format
rollout.py    ``RolloutModel``, ``PackedWeight``: weights quantized once per policy update, packed
"""
