"""Transfer evaluation and search: Ray Tune sweeps over fine-tuning runs, few-shot linear evaluation.

Writes MLflow only through `vitp.tracking`."""
