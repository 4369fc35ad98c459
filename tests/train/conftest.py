"""The training tests' shards: the debug corpus, preprocessed once per pytest process (tests/conftest.py)."""
import pytest


@pytest.fixture
def shards(debug_shards) -> str:
    return debug_shards


@pytest.fixture(scope="module")
def corpora(debug_shards, digits_shards, tmp_path_factory):
    """A work_dir whose shards/digits are the digits shards (where `vitp preprocess debug_finetune`
    puts them), the debug pre-training corpus, and the digits config: what the few-shot probes
    during pre-training read (tests/train/fewshot_probes.py)."""
    from vitp.recipes import resolve

    root = tmp_path_factory.mktemp("fewshot_train")
    (root / "shards").mkdir()
    (root / "shards" / "digits").symlink_to(digits_shards)
    digits = resolve("debug_finetune", [f"work_dir={root}"])
    return str(root), debug_shards, digits
