"""Preprocess driver memory: does the `vitp preprocess` driver stay flat, and see no pixels?

  .venv/bin/python benchmarks/preprocess_driver.py --sizes 2000 20000 100000 --cpus 2

Makes once per size N (under `--work`) N smooth 24x24 PNGs as ImageFolder (10 class dirs) and as
Parquet (the same bytes in 10 files, columns key/label/image, row groups of 1,000). Each (source,
N) runs `run_preprocess` (to 16 px uint8 shards) in a FRESH driver process (`--child`), measuring:
- peak RSS: the driver's `ru_maxrss` over its life (imports, ray.init, preprocess); growth: the
  peak of RSS sampled every 0.2 s during `run_preprocess` minus the RSS just before it;
- bytes fetched: `Worker.deserialize_objects`, where the driver turns every Ray object it gets
  into a value (`ray.get` under any name, Ray Data iterators, metadata), is wrapped to sum the
  serialized sizes and the `image`/`data` cells of every pyarrow Table among the values;
  `ray.get` (and any ray.data alias of it) is wrapped too, as a cross-check;
- corpus files opened: the child runs under `strace -f --seccomp-bpf`; each open is attributed
  to its thread group (followed through clone); the driver's opens of files under the corpus
  are counted, pyarrow's C++ opens included, and so are the Ray workers' (proof that the trace
  sees the corpus being read). A `sys.addaudithook` counts the driver's Python-level opens.
The table is printed and appended to benchmarks/RESULTS.md (`--results PATH`, `--no-results`).
"""
from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # `vitp`; this script's directory (record.py) is sys.path[0]
    sys.path.insert(0, _ROOT)

from record import add_results_args, append_result  # noqa: E402  (benchmarks/record.py)
from vitp.config import Run

CLASSES = [f"class_{c:02d}" for c in range(10)]
PX = 24  # corpus images; preprocess resizes them to 16 px


def _png(i: int) -> bytes:
    """Image i: a seeded gradient with a flat rectangle (compresses like a small photo)."""
    rng = np.random.default_rng(i)
    y, x = np.mgrid[0:PX, 0:PX].astype(np.float32)
    a, b = rng.uniform(0.2, 1.0, 3), rng.uniform(0, 255, 3)
    img = np.stack([x * a[0] * 10, y * a[1] * 10, (x + y) * a[2] * 5], axis=-1) + b * 0.3
    r, c = rng.integers(0, PX // 2, 2)
    img[r:r + PX // 3, c:c + PX // 3] = rng.uniform(0, 255, 3)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _write_range(job: tuple[str, int, int]) -> list[tuple[str, str, bytes]]:
    """Write images [lo, hi) into the ImageFolder tree; return (key, label, bytes) for Parquet."""
    root, lo, hi = job
    rows = [(f"{CLASSES[i % 10]}/{i:06d}.png", CLASSES[i % 10], _png(i)) for i in range(lo, hi)]
    for key, _, data in rows:
        with open(os.path.join(root, key), "wb") as f:
            f.write(data)
    return rows


def make_corpus(work: str, n: int, procs: int) -> tuple[str, str]:
    """<work>/corpus-N/{imagefolder,parquet}, made once (a `.done` marker beside them)."""
    base = os.path.join(work, f"corpus-{n}")
    folder, parquet = os.path.join(base, "imagefolder"), os.path.join(base, "parquet")
    if os.path.exists(os.path.join(base, ".done")):
        return folder, parquet
    shutil.rmtree(base, ignore_errors=True)  # an unfinished one
    for d in [os.path.join(folder, c) for c in CLASSES] + [parquet]:
        os.makedirs(d)
    t0, jobs = time.time(), [(folder, lo, min(lo + 1000, n)) for lo in range(0, n, 1000)]
    with multiprocessing.Pool(procs) as pool:  # 1,000 images a job
        rows = [r for part in pool.map(_write_range, jobs) for r in part]
    for f in range(10):  # 10 files of contiguous rows, row groups of 1,000
        part = rows[f * n // 10:(f + 1) * n // 10]
        t = pa.table({"key": [r[0] for r in part], "label": [r[1] for r in part],
                      "image": pa.array([r[2] for r in part], pa.binary())})
        pq.write_table(t, os.path.join(parquet, f"part-{f:02d}.parquet"), row_group_size=1000)
    open(os.path.join(base, ".done"), "w").close()
    print(f"made {n} images in {folder} and {parquet} in {time.time() - t0:.0f}s", flush=True)
    return folder, parquet


def child(a: argparse.Namespace) -> None:
    """One preprocess in this (fresh) driver process; prints one JSON line of measurements."""
    corpus, audit = os.path.realpath(a.corpus), {"files": 0, "dirs": 0}

    def hook(event, args):  # Python-level opens (open, os.open) of corpus paths, any thread
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            p = os.path.realpath(os.fsdecode(args[0]))
            if p == corpus or p.startswith(corpus + os.sep):
                audit["dirs" if os.path.isdir(p) else "files"] += 1

    sys.addaudithook(hook)  # before any import: it sees the whole life of the driver
    import dataclasses, pickle, resource, threading  # noqa: E401
    import psutil
    import pyarrow.compute as pc
    import ray
    from ray._private import worker as ray_worker
    from vitp.data.commands import run_preprocess
    from vitp.recipes import debug
    ray.init(address="local", num_cpus=a.cpus, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    ray.data.DataContext.get_current().enable_progress_bars = False
    cfg = debug()  # the debug recipe with this corpus and 16 px storage
    cfg = dataclasses.replace(cfg, work_dir=a.out, data=dataclasses.replace(
        cfg.data, source=a.source, path=a.corpus, shards=os.path.join(a.out, "shards"),
        storage_size=16, image_size=16, num_classes=10, val_fraction=0.02, shard_mb=a.shard_mb))
    fetched = dict(bytes=0, objects=0, image_bytes=0, columns=set(), get_calls=0, get_value_bytes=0)
    orig_deser, orig_get = ray_worker.Worker.deserialize_objects, ray.get

    def deser(self, serialized, refs, *args, **kw):  # every object the driver materialises
        for obj in serialized:  # (data buffer, metadata, transport) as read from the store
            fetched["objects"] += 1
            fetched["bytes"] += sum(len(x) for x in obj[:2] if x is not None)
        values = orig_deser(self, serialized, refs, *args, **kw)
        for v in values:  # blocks: their columns, and the bytes of any image/data cells
            if isinstance(v, pa.Table):
                fetched["columns"].add(",".join(v.column_names))
                for name in set(v.column_names) & {"image", "data"}:
                    fetched["image_bytes"] += pc.sum(pc.binary_length(v.column(name))).as_py() or 0
        return values

    def size(v) -> int:  # best effort, for the ray.get cross-check
        try:
            return (sum(map(size, v)) if isinstance(v, (list, tuple)) else
                    v.nbytes if isinstance(v, pa.Table) else len(pickle.dumps(v)))
        except Exception:  # noqa: BLE001 - not picklable: size unknown
            return 0

    def get(*args, **kw):
        out = orig_get(*args, **kw)
        fetched["get_calls"] += 1
        fetched["get_value_bytes"] += size(out)
        return out

    ray.get, ray_worker.Worker.deserialize_objects = get, deser
    for mod in [m for name, m in sys.modules.items() if name.startswith("ray.data") and m]:
        if getattr(mod, "get", None) is orig_get:  # a `from ray import get` alias (none in 2.60)
            mod.get = get
    proc, peak, stop = psutil.Process(), [0], threading.Event()

    def sample():  # the driver's RSS every 0.2 s
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.2)
    maxrss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731 KB->MB
    rss0, maxrss0 = proc.memory_info().rss, maxrss()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.time()
    res = run_preprocess(Run.of(cfg), overwrite=True, log=lambda s: print(s, file=sys.stderr, flush=True))
    wall = time.time() - t0
    stop.set()
    sampler.join()
    peak[0] = max(peak[0], proc.memory_info().rss)
    ray_worker.Worker.deserialize_objects, ray.get = orig_deser, orig_get
    out = {"pid": os.getpid(), "wall_s": wall, "rss_before_mb": rss0 / 2**20,
           "sampled_peak_mb": peak[0] / 2**20, "growth_mb": (peak[0] - rss0) / 2**20,
           "maxrss_before_mb": maxrss0, "maxrss_mb": maxrss(), "audit": audit,
           **{k: res[k] for k in ("input", "written", "quarantined", "shards")},
           **fetched, "columns": sorted(fetched["columns"])}
    ray.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


_LINE, _RET = re.compile(r"^(\d+) +(.*)$"), re.compile(r"= (\d+)(?: <.*>)?$")
_OPEN = re.compile(r'open(?:at2?)?\((?:AT_FDCWD, |\d+, )?"([^"]*)", ([A-Z_|]+)')


def corpus_opens(log: str, root_pid: int, corpus: str) -> dict:
    """Successful opens under `corpus` in an strace log by the driver (thread group `root_pid`)
    and by other processes. In log order: a clone's return gives the new tid its thread group,
    an exit forgets it (tids are reused); a tid's lines printed before its clone's wait for it."""
    group, waiting, partial = {root_pid: root_pid}, {}, {}
    n = {"driver_files": 0, "driver_dirs": 0, "other_files": 0, "other_dirs": 0}

    def count(pid: int, text: str) -> None:  # a successful open (not "= -1 ...") under corpus
        m = _OPEN.search(text)
        if m and _RET.search(text) and (m.group(1) + "/").startswith(corpus + "/"):
            n[("driver_" if group[pid] == root_pid else "other_")
              + ("dirs" if "O_DIRECTORY" in m.group(2) else "files")] += 1

    with open(log, errors="replace") as f:
        for line in f:
            m = _LINE.match(line.rstrip("\n"))
            if not m:
                continue
            pid, text = int(m.group(1)), m.group(2)
            if text.endswith("<unfinished ...>"):
                partial[pid] = text[:-len("<unfinished ...>")]
                continue
            if text.startswith("<... "):  # "<... openat resumed>) = 3"
                text = partial.pop(pid, "") + text.split(">", 1)[-1]
            if text.startswith(("+++ exited", "+++ killed")):
                group.pop(pid, None)
            elif pid not in group:
                waiting.setdefault(pid, []).append(text)
            else:
                ret = _RET.search(text)
                if text.startswith(("clone", "fork", "vfork")) and ret and int(ret.group(1)) > 0:
                    tid = int(ret.group(1))
                    group[tid] = group[pid] if "CLONE_THREAD" in text else tid
                    for t in waiting.pop(tid, []):
                        count(tid, t)
                count(pid, text)
    n["unattributed_lines"] = sum(len(v) for v in waiting.values())
    return n


def run_child(a, source: str, n: int, corpus: str) -> dict:
    out = os.path.join(a.work, f"run-{source}-{n}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)  # the shards and the strace log
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--source", source, "--corpus",
           corpus, "--out", out, "--cpus", str(a.cpus), "--shard-mb", str(a.shard_mb)]
    log = os.path.join(out, "strace.log")
    if a.strace:  # only these syscalls stop the tracees (seccomp filter)
        cmd = ["strace", "-f", "--seccomp-bpf", "-q", "-o", log,
               "-e", "trace=open,openat,openat2,clone,clone3,fork,vfork"] + cmd
    r = subprocess.run(cmd, cwd=_ROOT, stdout=subprocess.PIPE, text=True, timeout=3600)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode or not lines:
        raise SystemExit(f"{source} {n}: child failed (rc {r.returncode}):\n{r.stdout[-3000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    res["strace"] = corpus_opens(log, res["pid"], os.path.realpath(corpus)) if a.strace else {}
    shutil.rmtree(os.path.join(out, "shards"), ignore_errors=True)  # keep the log, free the disk
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000, 100000])
    ap.add_argument("--cpus", type=int, default=2, help="ray.init(num_cpus=...) in each driver")
    ap.add_argument("--shard-mb", type=float, default=4.0, help="data.shard_mb (shard count)")
    ap.add_argument("--work", default="/tmp/vitp-preprocess-driver", help="corpora and outputs")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--source", "--corpus", "--out"):  # the child's arguments
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    add_results_args(ap)
    a = ap.parse_args()
    if a.child:
        return child(a)
    a.strace = shutil.which("strace") is not None  # else the audit hook's count only
    os.makedirs(a.work, exist_ok=True)
    rows, peaks, cols = [], {}, set()
    for n in a.sizes:
        folder, parquet = make_corpus(a.work, n, os.cpu_count() or 1)
        for source in ("imagefolder", "parquet"):
            corpus = folder if source == "imagefolder" else parquet
            st = (r := run_child(a, source, n, corpus))["strace"]
            print(f"{source} {n}: " + json.dumps(r), flush=True)
            if r["input"] != n or r["written"] + r["quarantined"] != r["input"]:
                raise SystemExit(f"{source} {n}: counts do not add up: {r}")
            opened = (f"{st['driver_files'] if st else '-'} / {r['audit']['files']}"
                      + (f" (workers {st['other_files']})" if st else ""))
            mb = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(corpus)
                     for f in fs) / 1e6
            peaks.setdefault(source, []).append(r["maxrss_mb"])
            cols.update(r["columns"])
            rows.append(f"| {source} | {n:,} | {mb:.2f} | {r['maxrss_mb']:.0f} | "
                        f"{r['growth_mb']:+.1f} | {r['bytes'] / 1024:.1f} ({r['objects']} "
                        f"objects) | {opened} | {r['image_bytes']} | {r['wall_s']:.0f} |")
    table = "\n".join([
        "| source | images | corpus MB | driver peak RSS (MB) | RSS growth during preprocess "
        "(MB) | bytes fetched by the driver (KB) | corpus files opened by the driver (syscall / "
        "Python) | image bytes in fetched blocks | wall s |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|", *rows])
    spread = {s: (min(v), max(v)) for s, v in peaks.items()}
    notes = (
        f"Bound: across {min(a.sizes):,}-{max(a.sizes):,} images the driver's peak RSS stays "
        f"within {max(hi - lo for lo, hi in spread.values()):.0f} MB ("
        + "; ".join(f"{s} {lo:.0f}-{hi:.0f} MB" for s, (lo, hi) in spread.items())
        + f"). {PX}x{PX} PNGs, 10 classes -> 16 px uint8 shards, shard_mb {a.shard_mb}, Ray "
        f"num_cpus {a.cpus}, a fresh driver per run. Peak RSS: ru_maxrss (imports, ray.init, "
        "preprocess). Growth: peak of RSS sampled every 0.2 s during run_preprocess minus RSS "
        "before it. Bytes fetched: serialized size of every object the driver deserialized in "
        "the call (Worker.deserialize_objects wrapped: ray.get by any name, Ray Data iterators, "
        "metadata); image bytes: `image`/`data` cells of the pyarrow blocks among them (columns "
        f"of all blocks fetched: {' | '.join(sorted(cols))}). Files opened: files under the "
        "corpus opened by driver threads per `strace -f --seccomp-bpf` (C++ opens included) / "
        "per a Python audit hook; workers: the strace count of all other processes. Directory "
        "listings (the plan) are not file opens. RSS does not depend on load; wall time does "
        "(the 2-core VM is shared with CI and another developer).")
    print(table + "\n\n" + notes)
    append_result(a.results, "Preprocess driver memory (`benchmarks/preprocess_driver.py`)",
                  table, notes=notes)


if __name__ == "__main__":
    main()
