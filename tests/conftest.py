"""Shared fixtures: one local Ray instance per pytest run (tests marked `ray` use it)."""
import pytest


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with 4 logical CPUs, started once and shut down at the end of the run."""
    import ray
    from ray.data import DataContext

    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 configure_logging=True, logging_level="WARNING")
        started = True
    DataContext.get_current().enable_progress_bars = False  # quiet logs
    yield ray
    if started:
        ray.shutdown()
