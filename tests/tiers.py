"""The long tier: what CI's two suites leave out to fit their budgets, marked in the test files.

`@pytest.mark.long(reason=...)` puts a test there; `@pytest.mark.long_cases(ID, ..., reason=...)`
only the parameter cases with those ids (CI keeps the others). The reason says what CI runs of the
same feature instead. tests/conftest.py calls `mark_long` before `-m` deselects, so `make test` and
`make test-e2e` (-m "... and not long") skip these and `make test-long` runs them."""
import pytest


def _reason(item, marker) -> str:
    reason = marker.kwargs.get("reason", "")
    if not isinstance(reason, str) or not reason.strip():
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{marker.name} needs reason=\"what CI runs instead\"")
    return reason


def mark_long(items, args) -> None:
    """Mark `long` the cases `long_cases` names; refuse a long marker without a reason and, when
    whole files are collected, a case id that names no case (a renamed or removed parameter)."""
    named: dict[str, tuple[set, set]] = {}  # function id -> (ids asked for, ids collected)
    for item in items:
        for marker in item.iter_markers("long"):
            _reason(item, marker)
        cases = item.get_closest_marker("long_cases")
        if cases is None:
            continue
        reason = _reason(item, cases)
        function = item.nodeid.split("[")[0]
        case = getattr(getattr(item, "callspec", None), "id", None)
        asked, seen = named.setdefault(function, (set(cases.args), set()))
        seen.add(case)
        if case in asked:
            item.add_marker(pytest.mark.long(reason=reason))
    if any("::" in a for a in args):  # single tests asked for: their siblings were not collected
        return
    stale = [f"{f}[{c}]" for f, (asked, seen) in named.items() for c in sorted(asked - seen)]
    if stale:
        raise pytest.UsageError(f"long_cases names no collected case: {', '.join(stale)} (renamed? fix the marker)")


def tier_in_source(source: str, name: str) -> str:
    """How a test file marks its test `name`: "long" (the whole test), "cases" (long_cases: some of
    its cases) or "" (CI runs it), read from the decorators above `def name(`."""
    import re

    match = re.search(rf"^([ \t]*)def {re.escape(name)}\(", source, re.M)
    if not match:
        return ""
    above = source[:match.start()].rstrip("\n").split("\n")
    block = []
    for line in reversed(above):  # the decorator block: up to the blank line or code before it
        if not line.strip() or not (line.startswith(match.group(1) + "@") or line.startswith(match.group(1) + " ")
                                    or line.startswith(match.group(1) + ")") or line.startswith(match.group(1) + "]")):
            break
        block.append(line)
    text = "\n".join(block)
    return "long" if "@pytest.mark.long(" in text else "cases" if "@pytest.mark.long_cases(" in text else ""
