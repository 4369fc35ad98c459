"""Cluster-facing commands: Ray job submission, job listing, the MLflow server.

`add_parsers(sub)` adds the subcommands to `vitp` and returns {name: handler}.
"""
from __future__ import annotations

import argparse
from typing import Callable


def add_parsers(sub) -> dict[str, Callable[[argparse.Namespace], int]]:
    return {}
