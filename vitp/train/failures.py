"""Which worker failures Ray Train retries: faults yes, a user's mistake no.

Owns the failure policy handed to Train's controller (controller.py's `Trainer`); the driver re-raises the
worker's own error (failures.final_error). Must not decide anything about faults themselves.
"""

from __future__ import annotations

from typing import Optional

from ray.train.v2._internal.execution.failure_handling import FailureDecision
from ray.train.v2._internal.execution.failure_handling.default import DefaultFailurePolicy

from ..errors import ConfigError, InputError, UserError

# Ray Train V2 retries every worker error up to FailureConfig(max_failures): right for a lost node
# or a killed process, wrong for a config value or a file the user must fix, which fails the same
# way on every attempt (printing its traceback once per attempt and rank). Train's failure policy
# is not a public setting: Trainer swaps it in for the default one. A ClusterError (the cluster
# or a store could not be reached) is still retried.
FINAL = (ConfigError, InputError)  # the same input fails the same way on every attempt


def final_error(error: BaseException) -> Optional[UserError]:
    """The lowest rank's ConfigError or InputError inside a Train failure, or the UserError our
    controller ended the run with (a gang not placed: placement.py); None if there is none (a
    fault, a bug)."""
    controller_failure = getattr(error, "controller_failure", None)
    if isinstance(controller_failure, UserError):
        return controller_failure
    failures = getattr(error, "worker_failures", None)
    if not isinstance(failures, dict):
        return None
    for rank in sorted(failures):
        if isinstance(failures[rank], FINAL):
            return failures[rank]
    return None


class UserErrorsAreFinal(DefaultFailurePolicy):
    """Train's default failure policy, except that a worker's ConfigError or InputError ends the
    run at once (the budgets of max_failures and preemptions are left for faults)."""

    def make_decision(self, training_failed_error):
        if final_error(training_failed_error) is not None:
            return FailureDecision.RAISE
        return super().make_decision(training_failed_error)
