"""Record how long each test file takes, for ordering files under `pytest -n` (tests/conftest.py).

    python tests/durations.py LOG [LOG ...]

reads the `--durations=0` lines of pytest logs (`.ci/run` prints 25; run a suite with
PYTEST_ARGS="-q --durations=0" for all) and merges each file's total seconds into
tests/durations.json. Only the order of files depends on it: a stale or missing entry makes a run
no less correct, at worst longer.
"""
import json
import re
import sys
from pathlib import Path

PATH = Path(__file__).with_name("durations.json")
LINE = re.compile(r"^(\d+\.\d+)s (?:setup|call|teardown)\s+(tests/[^:\s]+\.py)::")


def main(logs: list[str]) -> None:
    seconds: dict[str, float] = {}
    for log in logs:
        for line in Path(log).read_text(errors="replace").splitlines():
            m = LINE.match(line)
            if m:
                seconds[m.group(2)] = seconds.get(m.group(2), 0.0) + float(m.group(1))
    table = json.loads(PATH.read_text()) if PATH.exists() else {}
    table.update({name: round(s) for name, s in seconds.items()})
    PATH.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
    print(f"{len(seconds)} files from {len(logs)} log(s) -> {PATH}")


if __name__ == "__main__":
    main(sys.argv[1:])
