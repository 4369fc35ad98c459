"""Config overrides: typed, unknown keys rejected; set_values checks typed values from code."""
import pytest

from vitp.config import ConfigError, ExperimentConfig, apply_overrides, parse_value, set_values
from vitp.recipes import debug


def test_overrides_are_typed():
    cfg = apply_overrides(debug(), ["optim.lr=0.003", "parallel.zero_stage=3", "data.hflip=false",
                                    "model.representation_size=128", "data.mean=0.1,0.2,0.3",
                                    'tune.space={"optim.lr": [0.1, 0.2]}'])
    assert cfg.optim.lr == 0.003 and isinstance(cfg.optim.lr, float)
    assert cfg.parallel.zero_stage == 3 and isinstance(cfg.parallel.zero_stage, int)
    assert cfg.data.hflip is False
    assert cfg.model.representation_size == 128
    assert cfg.data.mean == (0.1, 0.2, 0.3)
    assert cfg.tune.space == {"optim.lr": [0.1, 0.2]}
    cfg = apply_overrides(cfg, ["model.representation_size=none"])
    assert cfg.model.representation_size is None


@pytest.mark.parametrize("item, needle", [
    ("parallel.zero_stage=two", "expected an integer"),
    ("optim.lr=fast", "expected a number"),
    ("data.hflip=maybe", "expected true or false"),
    ("parallel.precision=fp8", "one of 'bf16', 'fp16', 'fp32'"),
    ("optim.lr", "expected KEY=VALUE"),
    ("data.mean=1,2", "exactly 3 values"),
])
def test_bad_override_values(item, needle):
    with pytest.raises(ConfigError, match=needle):
        apply_overrides(debug(), [item])


def test_unknown_key_lists_its_sections_keys():
    with pytest.raises(ConfigError) as e:
        apply_overrides(debug(), ["optim.learning_rate=0.1"])
    msg = str(e.value)
    assert "optim.learning_rate" in msg and "optim.lr" in msg and "parallel.zero_stage" not in msg
    with pytest.raises(ConfigError, match="is a section"):
        apply_overrides(debug(), ["optim=1"])
    with pytest.raises(ConfigError, match="unknown config key"):
        ExperimentConfig.from_dict({"optim": {"lr": 0.1, "bogus": 1}})


@pytest.mark.parametrize("key, text, value", [
    ("optim.lr", "3e-3", 0.003),
    ("train.steps", "10_000", 10_000),
    ("train.steps", "1e3", 1000),
    ("data.hflip", "off", False),
    ("model.representation_size", "null", None),
    ("model.representation_size", "768", 768),
    ("parallel.precision", "fp32", "fp32"),
    ("data.std", "[0.2, 0.3, 0.4]", (0.2, 0.3, 0.4)),
    ("tune.space", '{"optim.lr": [0.01]}', {"optim.lr": [0.01]}),
])
def test_parse_value_gives_the_declared_type(key, text, value):
    parsed = parse_value(key, text)
    assert parsed == value and type(parsed) is type(value)


def test_parse_value_names_key_and_type():
    with pytest.raises(ConfigError, match="train.steps=ten: expected an integer"):
        parse_value("train.steps", "ten")
    with pytest.raises(ConfigError, match="unknown config key 'train.stepz'"):
        parse_value("train.stepz", "10")


def test_set_values_is_typed_and_returns_a_copy():
    base = debug()
    cfg = set_values(base, {"optim.lr": 1, "model.head": "finetune", "train.steps": 100.0,
                            "data.mean": [0.1, 0.2, 0.3], "work_dir": "elsewhere"})
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.train.steps == 100 and isinstance(cfg.train.steps, int)
    assert cfg.model.head == "finetune" and cfg.data.mean == (0.1, 0.2, 0.3)
    assert cfg.work_dir == "elsewhere"
    assert base == debug()  # the input is not modified
    assert set_values(base, {}) == base


@pytest.mark.parametrize("values, needle", [
    ({"optim.lr": "fast"}, "optim.lr='fast': expected a number"),
    ({"train.steps": 1.5}, "expected an integer"),
    ({"data.hflip": 1}, "expected true or false"),
    ({"parallel.precision": "fp8"}, "one of 'bf16', 'fp16', 'fp32'"),
    ({"model.variant": 16}, "expected a string"),
    ({"optim.learning_rate": 0.1}, "unknown config key 'optim.learning_rate'"),
    ({"optim": {"lr": 0.1}}, "is a section"),
])
def test_set_values_rejects_wrong_types_and_unknown_keys(values, needle):
    with pytest.raises(ConfigError, match=needle):
        set_values(debug(), values)


@pytest.mark.parametrize("key, says", [
    ("optim.lrr", "did you mean 'optim.lr'?"),  # a typo
    ("train.lr", "did you mean 'optim.lr'"),  # the right name in the wrong section (first)
    ("stepz", "did you mean 'train.steps'?"),  # a typo without its section
    ("optim.nosuch", "keys of optim: optim.name, optim.lr,"),  # nothing close: its section's keys
    ("nosuch.key", "`vitp config --keys` lists them all"),
])
def test_an_unknown_key_names_the_closest_keys_not_all_of_them(key, says):
    from vitp.config.overrides import field_type

    with pytest.raises(ConfigError) as e:
        field_type(key)
    assert str(e.value) == f"unknown config key {key!r}; " + str(e.value).split("; ", 1)[1]
    assert says in str(e.value) and "data.storage_format" not in str(e.value), str(e.value)


def test_every_key_is_described_with_its_type_value_default_and_schema_comment():
    """`vitp config --keys`: one entry per key --set takes, in schema order; the recipe's value and
    the schema default; the meaning is the comment on the field's line in schema.py, or the comment
    lines right above it."""
    import re
    from pathlib import Path

    from vitp.config import ExperimentConfig, valid_keys
    from vitp.config import schema
    from vitp.config.keydoc import key_docs, key_table
    from vitp.recipes import resolve

    cfg = resolve("debug", ["optim.lr=0.02", "data.path=/corpus"], check_paths=False)
    docs = key_docs(cfg)
    assert [d.key for d in docs] == valid_keys()

    def get(c, key):
        for part in key.split("."):
            c = getattr(c, part)
        return c

    for d in docs:
        assert d.value == get(cfg, d.key) and d.default == get(ExperimentConfig(), d.key), d
    assert all(d.meaning for d in docs), [d.key for d in docs if not d.meaning]  # a new key needs its comment
    by_key = {d.key: d for d in docs}
    assert by_key["optim.lr"].type == "float" and by_key["data.source"].type == "choice"
    assert "parquet" in by_key["data.source"].meaning  # a long Literal's choices go to the meaning

    # the comments, read here line by line (schema.py: one section class after another)
    lines = Path(schema.__file__).read_text().splitlines()
    section, seen_trailing, seen_block = "", 0, 0
    prefix = {"DataConfig": "data.", "ModelConfig": "model.", "OptimConfig": "optim.",
              "ParallelConfig": "parallel.", "TrainConfig": "train.", "TuneConfig": "tune.",
              "TrackingConfig": "tracking.", "ExperimentConfig": ""}
    for i, line in enumerate(lines):
        if m := re.match(r"^class (\w+)", line):
            section = m.group(1)
        m = re.match(r"^    (\w+): [^#]*?(?:#\s*(.*))?$", line)
        if not m or section not in prefix or f"{prefix[section]}{m.group(1)}" not in by_key:
            continue
        doc = by_key[f"{prefix[section]}{m.group(1)}"]
        if m.group(2):
            assert doc.meaning.startswith(m.group(2)), (doc, m.group(2))
            seen_trailing += 1
        elif lines[i - 1].lstrip().startswith("#"):
            block, j = [], i - 1
            while lines[j].lstrip().startswith("#"):
                block.insert(0, lines[j].strip().lstrip("#").strip())
                j -= 1
            assert doc.meaning == " ".join(block), doc
            seen_block += 1
    assert seen_trailing > 30 and seen_block >= 2, (seen_trailing, seen_block)

    table = key_table(cfg).splitlines()
    assert table[0].split()[:2] == ["key", "type"] and len(table) == 1 + len(docs)
    lr = next(line for line in table if line.startswith("optim.lr "))
    default = ExperimentConfig().optim.lr
    assert f" 0.02 (default {default})" in lr, lr  # the override, and the schema default beside it
