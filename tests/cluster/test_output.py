"""The filter in front of Ray's printer of worker output: chatter dropped, each warning shown once
with its source line, library deprecations dropped, everything else kept in order."""
from vitp.cluster.output import OutputFilter

WARN = ("/srv/vitp/train/loop.py:88: UserWarning: grad norm is not finite at step 3",
        "  warnings.warn(msg)")
DEPRECATION = ("/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: "
               "`torch.distributed.all_gather_into_tensor` is deprecated.", "  return func(*args, **kwargs)")


def test_chatter_dropped_warnings_once_our_lines_kept():
    f = OutputFilter()
    first = f.lines(["[run] step 5/60 loss 2.3", *WARN, "DeepSpeed cpu_adam built successfully",
                     "Progress bars disabled. To enable, set ...", *DEPRECATION,
                     "Reporting training result 1: TrainingReport(checkpoint=None, metrics={})",
                     "[run] step 10/60 loss 2.2"])
    assert first == ["[run] step 5/60 loss 2.3", *WARN, "[run] step 10/60 loss 2.2"]
    # the same warning from another worker, later: neither it nor its source line again
    again = f.lines([*WARN, "[run] step 15/60 loss 2.1"])
    assert again == ["[run] step 15/60 loss 2.1"]
    # a different warning is news; an indented line that is not after a dropped warning is kept
    other = f.lines(["/srv/x.py:1: UserWarning: another", "  src", "  indented output"])
    assert other == ["/srv/x.py:1: UserWarning: another", "  src", "  indented output"]


def test_a_record_left_empty_is_not_printed():
    printed = []
    show = OutputFilter().wrap(lambda data, **kw: printed.append((data, kw)))
    show({"lines": ["DeepSpeed cpu_adam built successfully"], "pid": 1})
    show({"lines": ["WARNING: 9 PYTHON worker processes have been started on node: 7c8a"], "pid": "raylet"},
         ignore_prefix=False)
    show({"lines": ["[run] done"], "pid": 1}, ignore_prefix=True)
    assert printed == [({"lines": ["[run] done"], "pid": 1}, {"ignore_prefix": True})]


def _logged(message: str, rank: int = 0) -> str:
    """`message` as a Train worker's log line reaches the driver (text format)."""
    import logging

    from vitp import console

    console.set_log_rank(rank)
    try:
        return console.LogFormatter().format(logging.makeLogRecord({"msg": message, "levelname": "INFO"}))
    finally:
        console.set_log_rank(None)


def test_on_a_terminal_progress_redraws_one_line_that_other_output_ends():
    import io

    from vitp.console import LiveLine

    term = io.StringIO()
    live = LiveLine(term)
    out = live.guard(term)  # what sys.stdout becomes
    show = OutputFilter(live).wrap(lambda data, **kw: out.write("\n".join(data["lines"]) + "\n"))
    show({"lines": [_logged("[run] step 5/20 loss 2.30 ETA 0h00m09s")]})
    show({"lines": [_logged("[run] step 10/20 loss 2.20 ETA 0h00m05s")]})
    evaluated = _logged("[run] step 20/20 loss 2.10 ETA 0h00m00s | val top1 0.400 loss 2.0")
    show({"lines": [evaluated]})
    out.write("[run] done\n")
    assert term.getvalue() == (  # the bar without the time, level and rank; the kept line with them
        "\r\x1b[K[#####...............] ETA 0h00m09s [run] step 5/20 loss 2.30 ETA 0h00m09s"
        "\r\x1b[K[##########..........] ETA 0h00m05s [run] step 10/20 loss 2.20 ETA 0h00m05s"
        f"\n{evaluated}\n[run] done\n")
    assert evaluated.endswith(" INFO [rank 0] [run] step 20/20 loss 2.10 ETA 0h00m00s | val top1 0.400 loss 2.0")


def test_driver_progress_is_a_line_in_logs_and_the_bar_on_a_terminal(monkeypatch):
    import io

    from vitp import console

    lines = []
    monkeypatch.setattr(console, "_live", None)  # not a terminal: the line, through log
    console.progress("preprocess: 50/200 inputs (ETA 6s)", 50, 200, "6s", lines.append)
    assert lines == ["preprocess: 50/200 inputs (ETA 6s)"]
    term = io.StringIO()
    monkeypatch.setattr(console, "_live", console.LiveLine(term))
    console.progress("preprocess: 100/200 inputs (ETA 3s)", 100, 200, "3s", lines.append)
    assert len(lines) == 1
    assert term.getvalue() == "\r\x1b[K[##########..........] ETA 3s preprocess: 100/200 inputs (ETA 3s)"
