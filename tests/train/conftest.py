"""The training tests' shards: the debug corpus, preprocessed once per pytest process (tests/conftest.py)."""
import pytest


@pytest.fixture
def shards(debug_shards) -> str:
    return debug_shards
