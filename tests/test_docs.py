"""The README fits a screen's worth of scrolling and indexes every doc; every concrete `vitp ...`
line the README and docs/ show is one today's parser takes (a renamed flag or a stale `--set` form
fails here, not in a user's shell); quoted results are in the files they cite."""
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_the_readme_is_short_starts_with_its_title_and_indexes_every_doc():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, len(lines)
    assert lines[0] == "# vit-pipeline"  # nothing above the title
    missing = [p.name for p in DOCS if f"docs/{p.name}" not in text]
    assert not missing, f"docs not in the README's index: {missing}"
    named = set(re.findall(r"docs/([\w.-]+\.md)", text))
    assert named <= {p.name for p in DOCS}, named - {p.name for p in DOCS}


def _vitp_lines(path: Path) -> list[str]:
    """Concrete `vitp` command lines in the file's code blocks: synopses (with [optional] parts,
    CAPITAL placeholders or ...) are left out."""
    out, fenced = [], False
    text = re.sub(r"\\\n\s*", " ", path.read_text())  # a command continued over lines with "\"
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        command = line.strip().removeprefix("$ ").split("  #")[0].strip()  # without its comment
        if (fenced and command.startswith("vitp ") and not re.match(r"vitp [\w-]+:", command)  # its output
                and not re.search(r"\[|\.\.\.|<|(?<![$\w{/])[A-Z][A-Z0-9_]{2,}\b", command)):  # ($VARS stay)
            out.append(command)
    return out


CASES = [(p, line) for p in [ROOT / "README.md", *DOCS] for line in _vitp_lines(p)]


def test_the_docs_show_commands():
    assert len(CASES) > 30, len(CASES)


@pytest.mark.parametrize("path, line", CASES, ids=[f"{p.name}:{line[:60]}" for p, line in CASES])
def test_every_vitp_line_in_the_docs_parses(path, line):
    from vitp.cli import build_parser

    words = shlex.split(line, comments=True)[1:]
    words = [w for w in words if w not in (">", "|")][:next((i for i, w in enumerate(words) if w in (">", "|")),
                                                            len(words))]
    try:
        args = build_parser().parse_args(words)
    except SystemExit as e:
        pytest.fail(f"{path.name}: `{line}` is refused by vitp's parser (exit {e.code})")
    _check_config(path, line, args)


def _shown_error(path: Path, line: str) -> str | None:
    """The error the doc prints under `$ line` (its `vitp CMD: ...` lines), or None if none."""
    m = re.search(re.escape(line) + r"\n(vitp [\w-]+: .*(?:\n  .*)*)", path.read_text())
    return m.group(1) if m else None


def _check_config(path: Path, line: str, args) -> None:
    """Every `--set`/`--space` key is one the schema has, and a line naming a recipe resolves with
    its `--set`s (no data paths read) or fails as the doc shows under it, message for message."""
    from vitp.config.overrides import field_type
    from vitp.errors import ConfigError
    from vitp.recipes import RECIPES, resolve

    for pair in [*(getattr(args, "overrides", None) or []), *(getattr(args, "space", None) or [])]:
        try:
            field_type(pair.split("=", 1)[0].strip())
        except ConfigError as e:
            pytest.fail(f"{path.name}: `{line}`: {e}")
    if getattr(args, "recipe", None) not in RECIPES:
        return
    try:
        resolve(args.recipe, getattr(args, "overrides", None) or [], check_paths=False)
        refused = None
    except ConfigError as e:
        refused = f"vitp {args.command}: {e}"
    shown = _shown_error(path, line)
    assert refused == shown, f"{path.name}: `{line}` gives\n{refused}\nwhere the doc shows\n{shown}"


# ------------------------------------------------------------------ results quoted in docs/demo.md

# demo-*.json: a run's own demo-result.json, as `vitp demo` wrote it; figure7-*.json: `vitp analyze`'s
# analysis.json of an export plus its run's last val/top1
RESULTS = ROOT / "docs" / "results"


def _demo_result(name: str) -> dict:
    import json

    return json.loads((RESULTS / f"demo-{name}.json").read_text())


def _group(saved: dict, source: str, fraction: float) -> dict:
    (g,) = [g for g in saved["groups"] if g["recipe"] == saved["main"]["recipe"]
            and g["source"] == source and g["train_fraction"] == fraction]
    return g


def _three(values) -> str:
    return " ".join(f"{v:.3f}" for v in values)


def test_every_demo_result_quoted_in_the_docs_is_the_file_it_cites():
    """docs/demo.md's table, low-data curve, few-shot range and stage times are the numbers in the
    demo-result.json files it names (docs/results/), formatted as the demo prints them."""
    from vitp.cli.demo_report import _duration

    text = (ROOT / "docs" / "demo.md").read_text()
    rows = re.findall(r"^\| `[^`]+` \(`docs/results/demo-(\w+)\.json`\) \| (.+) \|$", text, re.M)
    assert sorted(name for name, _ in rows) == ["quick", "seed0", "seed1", "seed2"], rows
    for name, cells in rows:
        saved = _demo_result(name)
        top = saved["headline"]
        wall, pre, scratch, margins, pixels = (c.strip() for c in cells.split("|"))
        assert wall == _duration(saved["seconds"]), name
        mean = (f" ({top['pre-trained']['mean']:.3f} +- {top['pre-trained']['std']:.3f})"
                if len(top["pre-trained"]["values"]) > 1 else "")
        assert pre == _three(top["pre-trained"]["values"]) + mean, name
        assert scratch == _three(top["scratch"]["values"]), name
        assert margins == " ".join(f"{100 * m:+.1f}" for m in saved["verdict"]["margins"]), name
        assert pixels == _three(top["linear on raw pixels"]["values"]), name

    seeds = [_demo_result(f"seed{n}") for n in range(3)]
    flat = " ".join(text.split())
    curve = re.findall(r"(\d+) %: ([\d., ]+) / ([\d., ]+) / (\d\.\d{3})", flat)
    assert [int(p) for p, *_ in curve] == [5, 20, 100], curve
    for percent, pre, scratch, pixels in curve:
        fraction = int(percent) / 100
        assert pre == ", ".join(f"{_group(s, 'pre-trained', fraction)['mean']:.3f}" for s in seeds), percent
        assert scratch == ", ".join(f"{_group(s, 'scratch', fraction)['mean']:.3f}" for s in seeds), percent
        assert {f"{_group(s, 'linear on raw pixels', fraction)['mean']:.3f}" for s in seeds} == {pixels}, percent

    low, high = re.search(r"\((\d\.\d\d)-(\d\.\d\d) at 5 images a class\)", flat).groups()
    five = [s["fewshot"]["demo_fractals"]["fewshot/5shot_top1"] for s in seeds]
    assert (low, high) == (f"{min(five):.2f}", f"{max(five):.2f}")

    run, stages = re.search(r"Stage times of the `--seed (\d)` run: ([^.]+)\.", flat).groups()
    timings = _demo_result(f"seed{run}")["timings"]
    assert stages == ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()), (stages, timings)


def test_the_mpp_results_are_the_files_they_cite():
    """docs/hybrid_and_mpp.md's masked-patch-prediction figures: the pre-training's loss and masked-
    colour top-1 are its MLflow histories (benchmarks/metric_history.py's file), the downstream
    comparison, low-data curve, few-shot probe and wall time the run's demo-result.json."""
    import json

    from vitp.cli.demo_report import _duration

    text = " ".join((ROOT / "docs" / "hybrid_and_mpp.md").read_text().split())
    history = json.loads((RESULTS / "demo-mpp-seed0-pretraining.json").read_text())["histories"]
    loss = {step: value for step, value in history["train/loss"]}
    quoted = re.search(r"6\.24 to (\S+) at step 50, (\S+) at step 100, (\S+) at 200, (\S+) at 600; colour top-1 "
                       r"of the masked patches (\S+) \(val\)", text).groups()
    assert quoted == (*(f"{loss[s]:.2f}" for s in (50, 100, 200, 600)), f"{history['val/top1'][-1][1]:.2f}")

    saved = _demo_result("mpp-seed0")
    top = saved["headline"]
    pre, scratch = re.search(r"MPP-pre-trained ([\d. /]+ = [\d.]+ \+- [\d.]+), scratch ([\d. /]+ = [\d.]+ \+- "
                             r"[\d.]+)\.", text).groups()
    for quote, group in ((pre, top["pre-trained"]), (scratch, top["scratch"])):
        values = " / ".join(f"{v:.3f}" for v in group["values"])
        assert quote == f"{values} = {group['mean']:.3f} +- {group['std']:.3f}"
    worse = sorted(-100 * m for m in saved["verdict"]["margins"])
    assert f"is {worse[0]:.1f}-{worse[-1]:.1f} points worse than scratch" in text
    for percent in (5, 100):
        means = [f"{_group(saved, kind, percent / 100)['mean']:.3f}" for kind in ("pre-trained", "scratch")]
        assert f"{percent}% {means[0]} vs {means[1]}" in text, (percent, means)
    shots = saved["fewshot"]["demo_fractals"]
    assert "1/5/10/25 shots: " + " / ".join(f"{shots[f'fewshot/{k}shot_top1']:.3f}" for k in (1, 5, 10, 25)) in text
    assert f"{_duration(saved['seconds'])} wall" in text


def test_the_figure_7_table_is_the_files_it_cites():
    """docs/hybrid_and_mpp.md's plain-vs-hybrid table: each row's attention distances, position-
    embedding correlation and val top-1 are the numbers in the docs/results/ file the row names
    (`vitp analyze`'s analysis.json of that export, plus the run's val/top1)."""
    import json

    text = (ROOT / "docs" / "hybrid_and_mpp.md").read_text()
    rows = re.findall(r"^\s*\| `(\S+)` \(`docs/results/(figure7-\w+\.json)`\) \| (.+) \|$", text, re.M)
    assert [variant for variant, _, _ in rows] == ["pico/8", "R8+pico/8"], rows
    for variant, name, cells in rows:
        saved = json.loads((RESULTS / name).read_text())
        heads, first, second, corr, top1 = (c.strip() for c in cells.split("|"))
        pixels, means = saved["attention_distance"]["pixels"], saved["attention_distance"]["layer_mean"]
        assert saved["model"]["variant"] == variant, name
        assert heads == ", ".join(f"{p:.1f}" for p in pixels[0]), name
        assert (first, second) == (f"{means[0]:.1f}", f"{means[1]:.1f}"), name
        assert corr == f"{saved['pos_embed']['distance_corr']:.3f}", name
        assert top1 == f"{saved['val_top1']:.3f}", name


# a figure with its unit, as the docs quote measurements
_FIGURE = re.compile(r"(\d[\d,]*(?:\.\d+)?)\s?(?:img/s|images/s|CPU-s|s\b|ms\b|GB|MB|%|x\b)")


def _benchmark_numbers() -> list[float]:
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text().replace(",", "")
    return [float(n) for n in re.findall(r"(?<![\w.])\d+(?:\.\d+)?", text)]


def _in(quoted: str, numbers: list[float]) -> bool:
    """`quoted` is one of `numbers` to the digits it shows (294 for 294.29, 0.42 for 0.4171)."""
    digits = len(quoted.split(".")[1]) if "." in quoted else 0
    return any(abs(n - float(quoted)) <= 0.5 * 10 ** -digits + 1e-9 for n in numbers)


def test_every_figure_a_sentence_cites_from_the_benchmark_results_is_there():
    """A sentence of README or docs/ that cites `benchmarks/RESULTS.md`: every figure it gives with a
    unit (s, CPU-s, img/s, GB, %, x, ...) is a number in that file, to the digits quoted. (Which
    table and row is left to the reader: a figure nowhere in the file was not measured.)"""
    numbers = _benchmark_numbers()
    checked, wrong = 0, []
    for path in [ROOT / "README.md", *DOCS]:
        # paragraphs, list items and table rows, then their sentences
        blocks = re.split(r"\n\s*\n|\n(?=\s*(?:- |\||#))", path.read_text())
        sentences = [s for b in blocks for s in re.split(r"(?<=[.;:])\s+(?=[A-Z`(])", " ".join(b.split()))]
        for sentence in sentences:
            if "benchmarks/RESULTS.md" not in sentence:
                continue
            for quoted in (q.replace(",", "") for q in _FIGURE.findall(sentence)):
                checked += 1
                if not _in(quoted, numbers):
                    wrong.append(f"{path.name}: {quoted} in {sentence[:160]!r}")
    assert checked >= 20, checked  # the sentences are still found
    assert not wrong, "\n".join(wrong)


def test_every_test_the_failure_table_names_is_there_and_placed_where_it_says():
    """docs/failures.md names, for each fault, the tests that show it and whether CI runs them or
    only the long tier: each is a test function of its file, and a row whose tests are all of one
    tier says so."""
    from tiers import tier_in_source

    text = (ROOT / "docs" / "failures.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "tests/" in line]
    assert len(rows) > 40, len(rows)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        # FILE::TEST or FILE::CLASS::TEST (a chain's step)
        found = re.findall(r"`(tests/[\w/]+\.py)::(?:(\w+)::)?(\w+)(?:\[[^\]]*\])?`", cells[2])
        assert found, row
        for path, cls, name in found:
            source = (ROOT / path).read_text()
            assert not cls or re.search(rf"^class {cls}\b", source, re.M), f"{path}::{cls}"
            assert re.search(rf"^\s*def {name}\(", source, re.M), f"{path}::{name}"
        named = [(path, name) for path, _, name in found]
        # marked long: every case; long_cases: some of them (CI runs the others)
        tiers = {{"long": "long", "cases": "both", "": "CI"}[tier_in_source((ROOT / path).read_text(), name)]
                 for path, name in named}
        if tiers == {"long"}:
            assert "long" in cells[3] and "CI" not in cells[3], row
        if tiers == {"CI"}:
            assert "CI" in cells[3] and "long" not in cells[3], row


def test_every_test_the_ci_coverage_table_names_runs_in_ci():
    """docs/testing.md's table of features the long tier held alone names, for each, a CI test:
    each is a test function of its file (or a test file) that is not marked long."""
    from tiers import tier_in_source

    text = (ROOT / "docs" / "testing.md").read_text()
    table = text[text.index("| feature | CI test (suite) |"):].split("\n\n")[0]
    rows = table.splitlines()[2:]
    assert len(rows) >= 10, rows
    for row in rows:
        cell = [c.strip() for c in row.strip("|").split("|")][1]
        named = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?(?:::(\w+))?(?:\[[^\]]*\])?`", cell)
        assert named, row
        for path, first, second in named:
            source = (ROOT / path).read_text()
            name = second or first
            if name:
                assert re.search(rf"^\s*def {name}\(", source, re.M), f"{path}::{name}"
                assert tier_in_source(source, name) != "long", f"{path}::{name} is marked long"
            else:
                assert re.search(r"^\s*def test_", source, re.M), path
