"""The README fits a screen's worth of scrolling and indexes every doc; every concrete `vitp ...`
line the README and docs/ show is one today's parser takes (a renamed flag or a stale `--set` form
fails here, not in a user's shell)."""
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
        build_parser().parse_args(words)
    except SystemExit as e:
        pytest.fail(f"{path.name}: `{line}` is refused by vitp's parser (exit {e.code})")
