"""`vitp`: one console script; gathers each command group's parsers (experiment, evaluate, cluster, demo).

Owns the one command registry and maps errors to one line `vitp CMD: ...` and an exit code (EXIT_CODES):
0 ok, 1 work failed or internal error (`vitp --debug CMD` shows the traceback), 2 bad input, 3 cluster
unreachable/refused, 4 job STOPPED, 130 interrupted, 141 stdout closed. Must not contain logic.
"""
from __future__ import annotations

import argparse
import os
import select
import sys

from vitp import __version__
from vitp.cli import cluster, demo, evaluate, experiment, plan
from vitp.cli.args import Handler, pick_recipe, recipe_from_run
from vitp.console import LOG_FORMAT_ENV, LOG_FORMATS, VERBOSE_ENV, quiet_env, quiet_loggers
from vitp.errors import UserError
from vitp.net import no_telemetry
from vitp.versions import check_versions

# The end of `vitp --help`. An invalid config lists its problems below the one line, one per line.
EXIT_CODES = """exit codes:
  0    success
  1    the work failed: a submitted job FAILED, a sweep trial failed, a demo stage failed,
       preprocess wrote nothing; or an internal error (a bug: one line, `vitp --debug CMD ...`
       shows the traceback)
  2    bad input you can fix: usage, config, paths and files, job specs, MLflow queries,
       an installed Ray, DeepSpeed or MLflow outside the versions vitp supports
  3    the Ray cluster or its Jobs API cannot be reached or refused the request; or a
       `vitp doctor` check failed
  4    a submitted job was STOPPED
  130  interrupted (Ctrl-C)
  141  stdout closed early (e.g. `vitp config debug | head -3`): the rest is not printed
"""
_FILE_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer killed by the pipe


class _ShowDefaults(argparse.HelpFormatter):
    """A command's help names each option's default, where it has one worth saying (not an
    unset None or an off switch) and its text does not already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default in (None, False, "", argparse.SUPPRESS) or not action.option_strings
                or "default" in text.lower() or isinstance(default, list) and not default):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake on the command line said in one line (`vitp plan: error: argument
    --gpus: 0: must be > 0; see vitp plan --help`), exit 2, instead of the usage block above it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    """The `vitp` parser; each command's parser carries its handler (the one registry, gathered
    from every group's add_parsers) as the `handler` default."""
    parser = _Parser(
        prog="vitp",
        description="Pre-train and transfer Vision Transformers on Ray (Data, Train + DeepSpeed, "
                    "Tune) with MLflow tracking.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    global_flags = {
        "--debug": "show the full traceback of an error",
        "--verbose": "show Ray's own INFO output (worker starts, dataset plans, reports); by default "
                     "only errors, warnings and vitp's lines",
    }
    for flag, text in global_flags.items():
        parser.add_argument(flag, action="store_true", help=f"{text} (before or after the command)")
    parser.add_argument("--version", action="version", version=f"vitp {__version__}")
    log_format_help = ("vitp's log lines (time, level, rank, message) as text or as one JSON object a "
                       f"line, for a cluster's log collector; also ${LOG_FORMAT_ENV}")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                        help=f"{log_format_help} (default text; before or after the command)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    handlers: dict[str, Handler] = {}
    for group in (plan, experiment, evaluate, cluster, demo):
        handlers.update(group.add_parsers(sub))
    for name, handler in handlers.items():
        sub.choices[name].set_defaults(handler=handler)
        sub.choices[name].formatter_class = _ShowDefaults
        for flag, text in global_flags.items():  # after the command too; absent, the top level's value stands
            sub.choices[name].add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=text)
        sub.choices[name].add_argument("--log-format", choices=LOG_FORMATS, default=argparse.SUPPRESS,
                                       help=log_format_help)
    return parser


def _say(command: str, message: str) -> None:
    from ..tracking.redact import redact_message  # lazy: only an error needs it

    print(f"vitp {command}: {redact_message(message)}", file=sys.stderr, flush=True)


def _file_error(e: OSError) -> str:
    if e.filename is not None and e.strerror:  # raised by open() and friends: name the path
        return f"{e.filename}: {e.strerror}"
    return str(e)


def _internal_error(command: str, e: BaseException) -> int:
    first = (str(e).strip().splitlines() or [""])[0]
    if type(e).__module__.startswith("ray."):  # the work failed on Ray (e.g. a Train worker raised)
        _say(command, f"failed on Ray: {type(e).__name__}: {first} (the workers' errors are in the "
                      "output above; --debug shows the driver's traceback)")
    else:
        _say(command, f"internal error: {type(e).__name__}: {first} (run with --debug for the traceback)")
    return 1


def _stdout_is_closed() -> bool:
    """True when the broken pipe is our stdout (`| head` went away), not some client's socket."""
    try:
        poller = select.poll()
    except AttributeError:  # no poll() (Windows): the pipe is almost surely stdout
        return True
    poller.register(sys.stdout.fileno(), select.POLLOUT)
    # A pipe whose reader has gone polls as POLLERR on its write end (Linux; POLLHUP elsewhere).
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))


def _quiet_stdout() -> int:
    # Send what is still buffered to /dev/null, so the flush at interpreter exit does not raise a
    # second BrokenPipeError, and stop without a word.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


def _run(args: argparse.Namespace) -> int:
    check_versions()  # Ray, DeepSpeed, MLflow within the bounds the code was written for
    pick_recipe(args)  # RECIPE, --config FILE or --like RUN
    recipe_from_run(args)  # runs:/RUN_ID -> that run's config, before any command reads it
    code = args.handler(args)
    sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
    return code


def main(argv: list[str] | None = None) -> int:
    no_telemetry()  # before anything imports mlflow: MLflow's telemetry, Ray's usage stats off unless opted in
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"
    if args.log_format:  # this process and, through the environment, every Ray process of the job
        os.environ[LOG_FORMAT_ENV] = args.log_format
    os.environ.update(quiet_env())  # before any command imports ray.data
    quiet_loggers()
    if args.debug:  # no mapping: every error ends in its traceback
        return _run(args)
    try:
        return _run(args)
    except BrokenPipeError as e:
        if _stdout_is_closed():
            return _quiet_stdout()
        return _internal_error(args.command, e)
    except UserError as e:  # includes ConfigError, InputError, ClusterError, TrackingError
        _say(args.command, str(e))
        return e.exit_code
    except _FILE_ERRORS as e:
        _say(args.command, _file_error(e))
        return 2
    except KeyboardInterrupt:
        _say(args.command, "interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - a bug: one line here, the traceback with --debug
        return _internal_error(args.command, e)
