"""Training: DeepSpeed engine and step (plain torch), the Ray Train loop, checkpoints, export."""
