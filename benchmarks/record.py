"""How a benchmark records its result: a section appended to benchmarks/RESULTS.md.

Each section holds the date, the exact command line that produced it, the machine (CPU count and
model, device name) and the table the script printed. Benchmarks write by default;
`--no-results` only prints, `--results PATH` appends elsewhere (tests use a temporary file).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def add_results_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", default=RESULTS, metavar="MD",
                        help="append the result table, command line, date and machine to this "
                             "markdown file (default benchmarks/RESULTS.md)")
    parser.add_argument("--no-results", dest="results", action="store_const", const=None,
                        help="only print the table; write no file")


def command_line() -> str:
    """This process's command line as a user would type it from the current directory."""
    exe = sys.executable
    rel = os.path.relpath(exe)
    if not rel.startswith(".."):
        exe = rel if os.sep in rel else f".{os.sep}{rel}"
    script = sys.argv[0]
    if os.path.isabs(script) and not os.path.relpath(script).startswith(".."):
        script = os.path.relpath(script)
    return shlex.join([exe, script, *sys.argv[1:]])


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: str | None = None) -> str:
    """`16 CPUs (AMD EPYC ...), device: NVIDIA H100 80GB HBM3` - device defaults to the CPU."""
    return (f"{os.cpu_count()} CPUs ({cpu_model()}), device: {device or 'CPU'}, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}")


def append_result(path: str | None, title: str, table: str, device: str | None = None,
                  notes: str = "") -> str | None:
    """Append one section to `path` (created with a heading if missing); None when `path` is None.

    Returns the path written."""
    if not path:
        return None
    now = datetime.datetime.now().astimezone()
    section = [f"## {title}, {now:%Y-%m-%d %H:%M %Z}", "",
               "Command (from the repository root):", "", "```", command_line(), "```", "",
               f"Machine: {machine(device)}; load average {os.getloadavg()[0]:.1f} at the end.", ""]
    if notes:
        section += [notes.strip(), ""]
    section += [table.strip(), ""]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a") as f:
        if new:
            f.write("# Benchmark results\n\n")
        else:
            f.write("\n")
        f.write("\n".join(section))
    print(f"appended to {path}", flush=True)
    return path
