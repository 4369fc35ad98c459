"""Running on a Ray cluster: joining one (connect.py), job specs (jobspec.py), the Jobs API (jobs.py).

Import the submodules directly; this package imports nothing.
"""
