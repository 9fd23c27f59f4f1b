"""logs: what a run writes. The stats a run keeps and logs.csv / eval.csv (metrics.py, also the one
reader of those csvs), wandb (wandb_log.py), TensorBoard (tensorboard_log.py), what a sweep fixed
(sweep_record.py), a population's lineage table pbt.csv (lineage.py: written by pbt/, read by
analysis/). settings.py: the logger config. Reading runs back is analysis/'s.

May import: errors, env, agent, learning.
"""
