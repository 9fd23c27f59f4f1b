"""analysis: runs on disk -> tables, figures, the report. Offline: it reads run dirs (logs.csv,
eval.csv, .hydra/) and never the training code.

runs.py         the one loader: find runs and mode=test dirs, read their config, seed and rows
                (load -> [Run]; load_runs -> one DataFrame), copy what a report reads (keep_runs)
scores.py       normalised scores, IQM / median / mean / optimality gap, stratified bootstrap
measures.py     the peers' measures (last 100 training episodes, or the last iteration's, at a budget),
                what compares (measure, env, env settings), spreads
baselines.py    published reference scores (baselines.yaml, with sources)
tables.py       each run's score curve and summary; per-task and across-task tables
figures.py      the plot command's and the report's figures (PNG, without pyplot)
formatting.py   how numbers are written
markdown.py     report.md
populations.py  a PBT population's figure: members' curves with their exploits, the best one's values
report.py       `python -m torchbeast_hydra.analysis.report PATH...`: the report command
plot_command.py `python -m torchbeast_hydra.analysis RUNS_DIR` (torchbeast-hydra-plot)

May import: errors, logs.
"""
