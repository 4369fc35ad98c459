"""Typed experiment configuration: the schema, `--set` overrides and typed edits, validation,
and the `Run` a command resolves once.

Import from here: `from vitp.config import ExperimentConfig, validate, ...`. The variant
table lives in `vitp.model.variants`. Must not import torch or ray (nor pyarrow at import).
"""
from ..errors import ConfigError
from .overrides import apply_overrides, field_type, parse_value, set_value, set_values, valid_keys
from .schema import (DataConfig, ExperimentConfig, ModelConfig, OptimConfig, ParallelConfig,
                     TrackingConfig, TrainConfig, TuneConfig, flatten)
from .validate import absolute_paths, derive_grad_accum, drill_steps, for_world, validate
from .run import Run  # noqa: E402 (after validate, which it uses)

__all__ = [
    "ConfigError", "ExperimentConfig", "DataConfig", "ModelConfig", "OptimConfig", "ParallelConfig",
    "TrainConfig", "TuneConfig", "TrackingConfig", "apply_overrides", "parse_value", "set_value",
    "set_values", "field_type", "valid_keys", "validate", "absolute_paths", "flatten", "for_world", "drill_steps",
    "derive_grad_accum", "Run",
]
