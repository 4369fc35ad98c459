"""The tracking.tags rule (rules.py's table holds which key follows it): MLflow's own rules for a tag
name and value, no mlflow.* or vitp.* names (those record who ran a run, from where, how it went), and
no control or invisible formatting characters (vitp/names.py's set). No torch or ray.
"""
from __future__ import annotations

import posixpath
import re
from typing import Any

from ..names import hidden_problem
from .rulekinds import Rule

# MLflow's own rules for a tag (mlflow/utils/validation.py): refused at the first log otherwise, mid-run
TAG_KEY = re.compile(r"[/\w.\- :]+")
MAX_TAG_KEY, MAX_TAG_VALUE = 250, 8000
# Tags a user may not set: MLflow's system tags (mlflow.user, mlflow.source.name, mlflow.parentRunId:
# who ran it, from where, which run it belongs under) and vitp's own (vitp.error, vitp.heartbeat, ...).
RESERVED_TAG_PREFIXES = ("mlflow.", "vitp.")


class Tags(Rule):
    what = (f"MLflow tags: keys of letters, digits, '_-. :/' (at most {MAX_TAG_KEY}), not mlflow.* or vitp.*, "
            f"string values (at most {MAX_TAG_VALUE}); no control or invisible characters")

    def problem(self, key: str, value: Any) -> str | None:
        if not isinstance(value, dict):
            return f"{key}={value!r}: expected a mapping (JSON object)"
        for k, v in value.items():
            hidden = hidden_problem(k, "a tag") if isinstance(k, str) else None
            if hidden:
                return f"{key}: tag name {k!r} {hidden}"
            if not isinstance(k, str) or not TAG_KEY.fullmatch(k) or len(k) > MAX_TAG_KEY or posixpath.normpath(k) != k \
                    or k == "." or k.startswith(("/", "..")):
                return (f"{key}: tag name {k!r} is not an MLflow tag name: letters, digits, '_', '-', '.', ' ', ':' "
                        f"and '/' (not at the start, no '..'), at most {MAX_TAG_KEY} characters")
            if k.lower().startswith(RESERVED_TAG_PREFIXES):
                return (f"{key}: tag name {k!r} is {'MLflow' if k.lower().startswith('mlflow.') else 'vitp'}'s own "
                        "(mlflow.* and vitp.* tags record who ran a run, from where and how it went): "
                        "choose a name outside them, e.g. team or data/version")
            if not isinstance(v, str) or len(v) > MAX_TAG_VALUE:
                return f"{key}[{k!r}]: a tag value is a string of at most {MAX_TAG_VALUE} characters"
            hidden = hidden_problem(v, "a tag")
            if hidden:
                return f"{key}[{k!r}]: the value {hidden}"
        return None

    def outside(self) -> list:
        return [{"a/../b": "x"}, {"": "x"}, {".": "x"}, {"k": "v" * (MAX_TAG_VALUE + 1)}, {"k\n": "v"}, {"k": 1},
                {"mlflow.user": "admin"}, {"mlflow.source.name": "x"}, {"MLflow.user": "x"}, {"vitp.error": "x"},
                {"a\u202eb": "x"}, {"k": "a\u202eb"}, {"k": "a\nb"}, {"k": "a\u200bb"}]

    def inside(self) -> list:
        return [{}, {"team": "vision", "data/version": "2"}, {"note": "caf\u00e9 \u65e5\u672c"}]
