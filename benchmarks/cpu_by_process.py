"""Where a command's CPU time goes, process by process: for test suites and runs that start many.

Run (from the repository root; Linux, it reads /proc):

  .venv/bin/python benchmarks/cpu_by_process.py -- make test
  .venv/bin/python benchmarks/cpu_by_process.py --top 20 -- .venv/bin/vitp pretrain debug

Ray starts its workers and actors from its own daemons, not as children of the command, so every
process on the machine is sampled every --interval seconds (user + system CPU from
/proc/PID/stat); what processes had used before the command started is subtracted. A process that
ends between two samples loses at most one interval of its CPU. Other load on the machine counts
too: run it on an otherwise idle machine.

Prints the wall time, the CPU seconds and the mean number of busy cores, then the CPU seconds per
kind of process (`ray::` actors and tasks by their name, `python -m X` by X, a script by its
file name, other programs by theirs) and the --top processes, also after a Ctrl-C. The command's
exit status is returned.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

TICKS = os.sysconf("SC_CLK_TCK")


def sample() -> dict[int, tuple[float, str]]:
    """{pid: (user + system CPU seconds, short name)} of every process that can be read now."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    text = f.read()
            except OSError:  # ended meanwhile
                continue
            comm, rest = text[text.index("(") + 1:].rsplit(")", 1)
            fields = rest.split()
            out[int(name)] = ((int(fields[11]) + int(fields[12])) / TICKS, comm)
    return out


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())
    except OSError:
        return ""


def kind(cmdline: str) -> str:
    """`ray::Name` for Ray's workers and actors (whatever method runs), `python -m X`, a Python
    script's file name, or else the program's."""
    if cmdline.startswith("ray::"):  # ray::Actor, ray::Actor.method or ray::task(...)
        return cmdline.split()[0].split("(")[0].split(".")[0]
    words = cmdline.split()
    if not words:
        return "?"
    program = os.path.basename(words[0])
    if program.startswith("python"):
        if "-m" in words[1:-1]:
            return f"python -m {words[words.index('-m') + 1]}"
        if "-c" in words[1:-1]:
            return "python -c"
        script = next((w for w in words[1:] if not w.startswith("-")), "")
        return f"python {os.path.basename(script)}" if script else program
    return program


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, default=0.25, help="seconds between samples (default 0.25)")
    ap.add_argument("--top", type=int, default=15, help="how many single processes to list (default 15)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG ...]")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command: give one after --")
    if not os.path.isdir("/proc/self"):
        ap.error("this needs Linux's /proc")

    before = {pid: cpu for pid, (cpu, _) in sample().items()}  # spent before the command: not counted
    used: dict[int, float] = {}  # pid -> CPU seconds since the start
    names: dict[int, tuple[str, str]] = {}  # pid -> (short name, command line), re-read when renamed
    t0 = time.monotonic()
    proc = subprocess.Popen(command)
    try:
        while True:
            for pid, (seconds, comm) in sample().items():
                used[pid] = seconds - before.get(pid, 0.0)
                known = names.get(pid)
                if known is None or known[0] != comm:  # new, or renamed (Ray names a worker per task)
                    names[pid] = (comm, command_line(pid) or (known[1] if known else comm))
            if proc.poll() is not None:
                break
            time.sleep(args.interval)
    except KeyboardInterrupt:  # Ctrl-C reached the command too: report what was measured until now
        proc.wait()
    wall = time.monotonic() - t0
    own = os.getpid()
    rows = sorted(((s, pid) for pid, s in used.items() if s >= 0.05 and pid != own), reverse=True)
    total = sum(s for s, _ in rows)
    by_kind = collections.Counter()
    for seconds, pid in rows:
        by_kind[kind(names[pid][1])] += seconds
    print(f"\n{' '.join(' '.join(command).split())}: exit {proc.returncode}, {wall:.1f} s wall, {total:.1f} CPU-s, "
          f"{total / wall:.2f} cores busy on average ({os.cpu_count()} here)")
    print("\n| CPU-s | share | processes of this kind |\n|---:|---:|---|")
    for name, seconds in by_kind.most_common():
        print(f"| {seconds:.1f} | {seconds / total:.0%} | `{name}` |")
    print(f"\n| CPU-s | pid | command line (top {args.top}) |\n|---:|---:|---|")
    for seconds, pid in rows[:args.top]:
        print(f"| {seconds:.1f} | {pid} | `{names[pid][1][:100]}` |")
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode  # killed by signal N: 128+N


if __name__ == "__main__":
    sys.exit(main())
