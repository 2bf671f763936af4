"""Ablation sweeps over precision presets, schedules, treatments or the per-GEMM matrix, with seeds
and intervals (the command line is ``launch/sweep.py``). In the order a sweep uses them:

``spec``     the sweep file's validation and the grid's expansion into ``Run`` objects
``runner``   status files, local execution (``--parallel``) and the SLURM job array
``results``  TensorBoard reading and the statistics: per-run numbers, pairing by seed, intervals,
             verdicts (``pretrain.evaluation.stats`` / ``extra_tokens``)
``report``   ``collect``: the CSV and Markdown tables, and the plots (``plots``); an RL sweep's
             results are ``pretrain.rl.sweep_results``
``cli``      ``launch/sweep.py``'s work in that order: validate every run before any starts, refuse
             runs made by other flags, run with progress (last loss, ETA), collect

Imports flow one way: cli -> report -> plots, results, runner -> spec.
"""
