"""vit-pipeline: pre-train and transfer Vision Transformers on Ray."""
__version__ = "0.1.0"
