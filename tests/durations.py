"""Record how long each test takes, for handing out files under `pytest -n` (tests/conftest.py).

    python tests/durations.py LOG [LOG ...]

reads the `--durations=0` lines of pytest logs (run a suite with PYTEST_ARGS="-q --durations=0";
`.ci/run` prints only the 25 slowest) and merges each test's seconds (setup + call + teardown)
into tests/durations.json; tests under a second are left out. A test file the logs ran replaces
all its entries (a renamed or removed test leaves none behind), so give the logs of every suite
that ran a file at once. Only the order in which files are handed out depends on it: a stale or
missing entry makes a run no less correct, at worst longer.
"""
import json
import re
import sys
from pathlib import Path

PATH = Path(__file__).with_name("durations.json")
LINE = re.compile(r"^(\d+\.\d+)s (?:setup|call|teardown)\s+(tests/\S+\.py::.+?)\s*$")  # ids may hold spaces


def main(logs: list[str]) -> None:
    seconds: dict[str, float] = {}
    for log in logs:
        for line in Path(log).read_text(errors="replace").splitlines():
            m = LINE.match(line)
            if m:
                seconds[m.group(2)] = seconds.get(m.group(2), 0.0) + float(m.group(1))
    table = json.loads(PATH.read_text()) if PATH.exists() else {}
    ran = {test.split("::")[0] for test in seconds}
    table = {test: s for test, s in table.items() if test.split("::")[0] not in ran}
    table.update({test: round(s) for test, s in seconds.items() if s >= 1})
    root = PATH.parent.parent
    table = {test: s for test, s in table.items() if (root / test.split("::")[0]).is_file()}
    PATH.write_text(json.dumps(dict(sorted(table.items())), indent=0) + "\n")
    print(f"{len(seconds)} tests from {len(logs)} log(s) -> {PATH}")


if __name__ == "__main__":
    main(sys.argv[1:])
