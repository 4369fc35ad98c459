"""vitp's library log lines: time, level and rank on every line, as text or JSON, INFO on stdout and
warnings on stderr, whoever drives the library (the `vitp` command or Python)."""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys

import pytest

from vitp import console

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def rank_reset():
    yield
    console.set_log_rank(None)


def _when(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_text_lines_carry_time_level_and_rank(monkeypatch, capsys, rank_reset):
    monkeypatch.delenv(console.LOG_FORMAT_ENV, raising=False)
    log = console.get_logger("vitp.test.lines")
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    log.info("[run] on the driver %d", 1)
    console.set_log_rank(3)
    log.warning("[run] on rank three")
    out, err = capsys.readouterr()
    m = re.fullmatch(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)Z INFO \[driver\] \[run\] on the driver 1\n", out)
    assert m, out
    assert before <= _when(m.group(1) + "Z") <= datetime.datetime.now(datetime.timezone.utc)
    assert re.fullmatch(r"\S+ \S+Z WARNING \[rank 3\] \[run\] on rank three\n", err), err
    assert console.TEXT_LOG_PREFIX.sub("", err.strip()) == "[run] on rank three"


def test_json_lines_parse_and_keep_the_traceback(monkeypatch, capsys, rank_reset):
    monkeypatch.setenv(console.LOG_FORMAT_ENV, "json")
    log = console.get_logger("vitp.test.lines")
    console.set_log_rank(0)
    log.info('a "quoted" message\nover two lines')
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    out, err = capsys.readouterr()
    (info,) = [json.loads(line) for line in out.splitlines()]  # one line however many the message had
    assert info["message"] == 'a "quoted" message\nover two lines'
    assert (info["level"], info["rank"], info["logger"]) == ("INFO", 0, "vitp.test.lines")
    assert _when(info["time"]).tzinfo is not None and info["time"].endswith("Z")
    (error,) = [json.loads(line) for line in err.splitlines()]
    assert error["level"] == "ERROR" and "ValueError: boom" in error["exception"]
    console.set_log_rank(None)
    log.info("driver")
    assert json.loads(capsys.readouterr().out)["rank"] is None


def test_an_unknown_format_in_the_environment_falls_back_to_text(monkeypatch):
    monkeypatch.setenv(console.LOG_FORMAT_ENV, "xml")
    assert console.log_format() == "text" and console.log_env() == {}
    monkeypatch.setenv(console.LOG_FORMAT_ENV, "json")
    assert console.log_env() == {console.LOG_FORMAT_ENV: "json"}  # what every Ray process of a job gets


def test_debug_lines_show_with_verbose_only(monkeypatch, capsys):
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    console.get_logger("vitp.test.lines").debug("hidden")
    assert capsys.readouterr().out == ""
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    console.get_logger("vitp.test.lines").debug("shown")
    assert capsys.readouterr().out.endswith(" DEBUG [driver] shown\n")
    monkeypatch.delenv(console.VERBOSE_ENV)
    console.get_logger("vitp.test.lines")  # back to INFO for whatever runs next in this process


def test_the_command_line_flag_sets_the_format_for_the_process_and_its_ray_jobs():
    """`--log-format json` after the command (or before it): that process's library lines are JSON,
    and Ray processes it starts inherit the environment variable (connect_ray passes it to a
    remote cluster's job)."""
    code = ("import os, vitp.cli\n"
            "from vitp.console import get_logger\n"
            "assert vitp.cli.main(['config', 'debug', '--log-format', 'json']) == 0\n"
            "get_logger('vitp.train.trainer').info('from the library')\n")
    env = {k: v for k, v in os.environ.items() if k != console.LOG_FORMAT_ENV}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=env)
    assert r.returncode == 0, r.stderr
    last = json.loads(r.stdout.splitlines()[-1])
    assert last["message"] == "from the library" and last["rank"] is None


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_secret_in_a_log_line_is_masked_whoever_logs_it(monkeypatch, capsys, rank_reset, fmt):
    """A secret this process holds (an environment variable named as one) never reaches a log line,
    in the message or in a traceback, whichever logger writes it through vitp's formatter."""
    import secrets

    secret = f"lg{secrets.token_hex(6)}/p+w"
    monkeypatch.setenv("DB_PASS", secret)
    monkeypatch.setenv(console.LOG_FORMAT_ENV, fmt)
    log = console.get_logger("vitp.test.secret")
    log.warning("connecting with %s", secret)
    try:
        raise RuntimeError(f"login refused for {secret}")
    except RuntimeError:
        log.exception("failed")
    err = capsys.readouterr().err
    assert secret not in err and "***" in err and "login refused for" in err, err
