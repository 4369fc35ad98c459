"""How many logical CPUs connect_ray's local Ray asks for (no Ray started): a sweep's concurrent
trials each get their Train workers' slots and their readers'."""
import os


def test_a_local_ray_has_slots_for_the_readers_of_every_trial_a_sweep_runs_at_once():
    from vitp.cluster.connect import READER_CPUS, local_cpus
    from vitp.recipes import resolve

    one = resolve("demo_fractals", ["parallel.num_workers=1", "parallel.cpus_per_worker=1"], check_paths=False)
    assert local_cpus(one) == max(os.cpu_count() or 1, 1 + READER_CPUS)
    two = resolve("demo_fractals", ["parallel.num_workers=1", "parallel.cpus_per_worker=1",
                                    "tune.max_concurrent_trials=2"], check_paths=False)
    assert local_cpus(two) == max(os.cpu_count() or 1, 2 * (1 + READER_CPUS))
