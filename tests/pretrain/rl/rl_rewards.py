"""A custom reward for the RL-loop tests (``--reward-function tests/pretrain/rl/rl_rewards.py:odd``).

A randomly initialised policy never writes an exact answer, so the task's reward is 0 for every
response and GRPO's advantages vanish; this one depends on which characters were sampled, so it
varies within a group from the first step (and a policy can learn to raise it).
"""


def odd(problem, response: str, spec) -> float:
    """The fraction of the response's characters with an odd code point (0 for an empty response)."""
    return sum(ord(ch) % 2 for ch in response) / len(response) if response else 0.0
