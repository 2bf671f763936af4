"""Evaluation beyond the loss: our GPT under the EleutherAI lm-evaluation-harness.

  lm_eval_adapter  ``MegatronLM``: lm-eval's ``LM`` (loglikelihood, loglikelihood_rolling,
                   generate_until) over a TP=1 policy GPT and a Megatron-style tokenizer
  hf_tokenizer     ``HFTokenizer``: a local Hugging Face tokenizer behind that interface
  mc_task          local offline tasks from ``configs/eval/*.yaml`` (``local_python_mc``)
  loading          ``load_for_eval``: converted HF, training-checkpoint and plain weight files
  results          result rows, Markdown/CSV tables and the A-vs-B delta table
  stats            paired intervals over seeds, Holm-adjusted and equivalence (TOST) verdicts
  extra_tokens     the study's extra-tokens metric (both ways) and fitted L(D) = E + A*D^-alpha

Entry point: ``launch/evaluate.py``. Needs ``lm-eval`` (``pip install lm-eval==0.4.13``).
"""
