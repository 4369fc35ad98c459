"""Evaluation, one room: a model or weights scored on a dataset's shards, as big_vision's evaluators
are. features.py (frozen pre-logit features, Ray Data), solver.py (the few-shot least squares,
NumPy), fewshot.py (`vitp fewshot`: its own MLflow run), probe.py (the few-shot probes during
pre-training), reference.py (logistic regression on raw pixels). Import submodules directly.
"""
