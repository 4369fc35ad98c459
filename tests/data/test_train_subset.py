"""data.train_fraction and the posed fractals the demo's downstream task is made of: subsets are
nested and leave the val split alone; a pose makes raw pixels a weak feature."""
import numpy as np
import pyarrow as pa
import pytest

from vitp.data.rows import assign_split, in_train_subset, subset_train
from vitp.data.synth import class_system, render

KEYS = [f"class_{i % 10}/img_{i:05d}.png" for i in range(4000)]


def test_train_subsets_are_nested_and_near_their_fraction():
    kept = {f: {k for k in KEYS if in_train_subset(k, f)} for f in (0.05, 0.2, 1.0)}
    assert kept[0.05] < kept[0.2] < kept[1.0] == set(KEYS)
    for f in (0.05, 0.2):  # a hash, so binomial: within 5 standard deviations
        n, sd = len(KEYS) * f, (len(KEYS) * f * (1 - f)) ** 0.5
        assert abs(len(kept[f]) - n) < 5 * sd, (f, len(kept[f]))


def test_subset_cuts_only_the_train_split():
    splits = ["", "", "val", "train"] * (len(KEYS) // 4)  # unsplit items are split by hash
    table = pa.table({"key": KEYS, "split": splits})
    out = subset_train(table, val_fraction=0.5, train_fraction=0.2)
    split_of = {k: assign_split(k, s, 0.5) for k, s in zip(KEYS, splits)}
    got = out.column("key").to_pylist()
    val = [k for k in KEYS if split_of[k] == "val"]
    assert [k for k in got if split_of[k] == "val"] == val  # every val item, in order
    train = [k for k in got if split_of[k] == "train"]
    assert train == [k for k in KEYS if split_of[k] == "train" and in_train_subset(k, 0.2)]
    assert subset_train(table, 0.5, 1.0) is table


@pytest.mark.long(reason="checks the synthetic data or import costs, whose subjects change rarely")
@pytest.mark.slow  # renders and fits a corpus
def test_posed_fractals_defeat_a_linear_classifier_on_raw_pixels():
    """Unposed, every image of a class sits at the same place and a logistic regression on the
    pixels separates 10 classes almost perfectly; posed, it must learn the shape instead."""
    from sklearn.linear_model import LogisticRegression

    x, y = [], []
    for c in range(10):
        system = class_system(7, c)
        for i in range(60):
            x.append(render(7, c, i, 32, system).astype(np.float32).ravel() / 255)
            y.append(c)
    x, y = np.stack(x), np.array(y)
    test = np.arange(len(y)) % 3 == 0
    clf = LogisticRegression(max_iter=300).fit(x[~test], y[~test])
    acc = clf.score(x[test], y[test])
    assert 0.1 < acc < 0.6, acc
