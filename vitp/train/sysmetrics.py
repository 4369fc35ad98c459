"""System metrics of a training run (tracking.system_metrics): CPU and memory of rank 0's node,
its process's resident memory, and each visible GPU's memory, under MLflow's `system/` names (the
UI's System metrics tab). Logged with the step's metrics, so they share the spool in an outage.
"""
from __future__ import annotations

import psutil
import torch

MB = 2 ** 20


class SystemSampler:
    """`sample()`: the node's state now; CPU utilisation is the average since the previous call."""

    def __init__(self):
        self.process = psutil.Process()
        psutil.cpu_percent(None)  # the first reading is meaningless: start the interval here

    def sample(self) -> dict[str, float]:
        vm = psutil.virtual_memory()
        out = {"system/cpu_utilization_percentage": psutil.cpu_percent(None),
               "system/system_memory_usage_megabytes": (vm.total - vm.available) / MB,
               "system/system_memory_usage_percentage": vm.percent,
               "system/process_rss_megabytes": self.process.memory_info().rss / MB}
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                free, total = torch.cuda.mem_get_info(i)
                out[f"system/gpu_{i}_memory_usage_megabytes"] = (total - free) / MB
                out[f"system/gpu_{i}_memory_usage_percentage"] = 100.0 * (total - free) / total
        return out
