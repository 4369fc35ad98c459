"""The long tier (tests/long.txt): what CI's two suites leave out to fit their budgets. tests/conftest.py
marks its tests `long`, so `make test` and `make test-e2e` (-m "... and not long") skip them and
`make test-long` runs them."""
import os
from pathlib import Path

LONG = Path(__file__).with_name("long.txt")


def long_entries() -> list[str]:
    """tests/long.txt's entries: test ids, or a test function's id for all of its parameters."""
    lines = (line.strip() for line in LONG.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def is_long(nodeid: str, entries: list[str]) -> bool:
    return any(nodeid == e or nodeid.startswith(e + "[") for e in entries)


def stale_entries(entries: list[str], nodeids: list[str], args: list[str], root: Path) -> list[str]:
    """The entries that name no test of a file collected whole (one of `args` is the file or a
    directory above it; with no args, the rootdir's tests): renamed or removed tests."""
    whole = [os.path.abspath(a) for a in args if "::" not in a] if args else [str(root)]
    files = {n.split("::")[0] for n in nodeids}

    def collected_whole(path: str) -> bool:
        full = str(root / path)
        return path in files and any(full == w or full.startswith(w.rstrip(os.sep) + os.sep) for w in whole)

    return [e for e in entries if collected_whole(e.split("::")[0]) and not any(is_long(n, [e]) for n in nodeids)]
