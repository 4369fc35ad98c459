"""A job spec's entrypoint, shell text run by the cluster's shell: the `vitp` calls in it (subcommand,
recipe, --set items, a sweep's --datasets) and `--set` inserted after each as text. It is scanned,
never re-quoted, so $VARS expand there and operators and redirections stay as written.
"""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from itertools import islice

from vitp import recipes
from vitp.config.files import like_recipe
from vitp.errors import ConfigError
from vitp.tracking.redact import redact_text

# vitp subcommands whose first positional argument is a recipe name. `doctor` too: a spec's gate
# (`vitp doctor RECIPE --allreduce ... && vitp pretrain RECIPE ...`) must check the gang and work_dir
# the run will have, so `vitp submit --set` reaches it as it reaches the run.
RECIPE_COMMANDS = {"config", "synth", "preprocess", "pretrain", "finetune", "sweep", "fewshot", "doctor"}
# Options of those subcommands that take a value (so the value is not mistaken for the recipe).
_VALUE_OPTIONS = {"--set", "--from", "--address", "--out", "--tracking-uri", "--name", "--datasets",
                  "--space", "--scheduler", "--experiment", "--sweep", "--tag", "--filter",
                  "--format", "--plot", "--recipe", "--search", "--log-format", "--job-tracking-uri",
                  "--min-busbw"}
_GLOBAL_FLAGS = {"--debug"}  # vitp's own options, given before the subcommand


@dataclass
class VitpCall:
    """One `vitp SUBCOMMAND [RECIPE] ...` found in an entrypoint."""

    subcommand: str
    recipe: str | None
    overrides: list[str]
    end: int  # offset in the entrypoint where this command's words end (`--set` goes there)
    datasets: list[str] = field(default_factory=list)  # `vitp sweep --datasets A,B`

    @property
    def recipes(self) -> list[str]:
        """Every recipe this call runs: its RECIPE, and a sweep's --datasets."""
        return list(dict.fromkeys(([self.recipe] if self.recipe else []) + self.datasets))

    def configs(self, check_paths: bool = False) -> list:
        """Each recipe's resolved config, with the `--set` items that reach it (a sweep's
        `RECIPE:KEY=VALUE` to that recipe only)."""
        if self.subcommand != "sweep":
            return [recipes.resolve(self.recipe, self.overrides, check_paths=check_paths)]
        recipes.check_scoped(self.overrides, self.recipes)
        return [recipes.resolve(r, recipes.overrides_for(r, self.overrides), check_paths=check_paths)
                for r in self.recipes]


# The entrypoint is shell text run by the cluster's shell: it is scanned (never re-quoted), so
# $VARS expand there and operators and redirections stay as written. `--set` is inserted as text.


def _skip_quoted(text: str, i: int, close: str) -> int:
    """Index after the `close` that ends the quoted or nested part starting at text[i]."""
    opener, depth = {")": "(", "}": "{"}.get(close), 0
    while i < len(text):
        c = text[i]
        if close == "'":
            if c == "'":
                return i + 1
        elif c == "\\":
            i += 1
        elif c == close and depth == 0:
            return i + 1
        elif opener and c in (opener, close):
            depth += 1 if c == opener else -1
        elif c == "`" or (c in "'\"" and close != '"'):
            i = _skip_quoted(text, i + 1, c) - 1
        elif c == "$" and text[i + 1:i + 2] in ("(", "{"):
            i = _skip_quoted(text, i + 2, ")" if text[i + 1] == "(" else "}") - 1
        i += 1
    raise ConfigError(f"entrypoint {redact_text(text)!r}: unbalanced {close!r}: close the quote or bracket")


def command_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each simple command of a shell command line, split at && || ; | & ( ) and
    newlines; quotes, escapes, $(...), ${...}, `...` and comments respected; trailing blanks cut."""
    spans, start, i, n = [], 0, 0, len(text)
    while i < n:
        c, nxt = text[i], text[i + 1:i + 2]
        if c == "\\":
            i += 2
        elif c in "'\"`":
            i = _skip_quoted(text, i + 1, c)
        elif c == "$" and nxt in ("(", "{"):
            i = _skip_quoted(text, i + 2, ")" if nxt == "(" else "}")
        elif c == "#" and (i == 0 or text[i - 1] in " \t\n;&|()"):
            spans.append((start, i))  # a comment runs to the end of the line
            start = i = n if text.find("\n", i) < 0 else text.find("\n", i)
        elif c in ";&|()\n" and not (c in "&|" and text[i - 1:i] in ("<", ">")) and not (c == "&" and nxt == ">"):
            spans.append((start, i))  # `>&`, `<&`, `>|` and `&>` are redirections, not operators
            i += 2 if text[i:i + 2] in ("&&", "||", ";;", "|&") else 1
            start = i
        else:
            i += 1
    spans.append((start, n))
    out = []
    for s, e in spans:
        while e > s and (text[e - 2:e] == "\\\n" or (text[e - 1].isspace() and text[e - 2:e - 1] != "\\")):
            e -= 2 if text[e - 2:e] == "\\\n" else 1  # blanks and line continuations
        if text[s:e].strip():
            out.append((s, e))
    return out


_REDIRECT = re.compile(r"^\d*(&>>?|>>?|<<?|>&|<&|>\|)(.*)$")
_PREFIX_WORDS = {"if", "then", "elif", "else", "do", "while", "until", "{", "!", "time", "exec", "command", "env"}


def _words(text: str) -> list[str]:
    """The words of one simple command, less redirections, leading keywords and VAR=value."""
    try:
        tokens = shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"entrypoint {redact_text(text)!r}: {e}: fix the quoting") from None
    words, skip = [], False
    for tok in tokens:
        m = _REDIRECT.match(tok)
        if skip or m:
            skip = not skip and bool(m) and not m.group(2)  # `> file`: the next word is the target
            continue
        words.append(tok)
    while words and (words[0] in _PREFIX_WORDS or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])):
        words = words[1:]
    return words


def _vitp_args(words: list[str]) -> list[str] | None:
    """The arguments after `vitp` / `python -m vitp.cli`, or None for another command."""
    if words and os.path.basename(words[0]) == "vitp":
        return words[1:]
    if len(words) >= 3 and os.path.basename(words[0]).startswith("python") and words[1:3] == ["-m", "vitp.cli"]:
        return words[3:]
    return None


def parse_entrypoint(entrypoint: str) -> list[VitpCall]:
    """Every vitp call in the entrypoint, with its recipe, `--set` overrides and where it ends."""
    calls = []
    for start, end in command_spans(entrypoint):
        args = _vitp_args(_words(entrypoint[start:end]))
        while args and args[0] in _GLOBAL_FLAGS:  # `vitp --debug pretrain ...`
            args = args[1:]
        if not args:
            continue
        sub, recipe, overrides, datasets = args[0], None, [], []
        rest = iter(args[1:])
        for a in rest:
            if a == "--set" or a.startswith("--set="):
                overrides.extend([a[len("--set="):]] if a.startswith("--set=") else islice(rest, 1))
            elif (a == "--datasets" or a.startswith("--datasets=")) and sub == "sweep":
                value = a[len("--datasets="):] if a.startswith("--datasets=") else next(rest, "")
                datasets = [d.strip() for d in value.split(",") if d.strip()]
            elif a == "--recipe" and sub == "compare":
                recipe = next(rest, None)  # `vitp compare --recipe R` reads R's MLflow store
            elif a.split("=", 1)[0] in ("--config", "--like") and sub in RECIPE_COMMANDS:  # RECIPE's spellings
                value = a.split("=", 1)[1] if "=" in a else next(rest, "")
                recipe = value if a.startswith("--config") else like_recipe(value)
            elif a in _VALUE_OPTIONS:
                next(rest, None)
            elif not a.startswith("-") and recipe is None and sub in RECIPE_COMMANDS:
                recipe = a
        calls.append(VitpCall(sub, recipe, overrides, end, datasets))
    return calls


_SHELL_REF = re.compile(r"\$[A-Za-z_{(]")


def add_overrides(entrypoint: str, overrides: list[str]) -> str:
    """Append `--set k=v` to every `vitp <command> RECIPE` of the entrypoint (`RECIPE:k=v`: to the
    calls that run that recipe only; a sweep over several --datasets gets it as `RECIPE:k=v`, which
    it applies to that dataset's trials). The entrypoint's text is kept as written; only the values
    are quoted."""
    calls = [c for c in parse_entrypoint(entrypoint) if c.subcommand in RECIPE_COMMANDS and c.recipe]
    if overrides and not calls:
        raise ConfigError(f"--set needs a `vitp <command> RECIPE` in the entrypoint, found none in "
                          f"{redact_text(entrypoint)!r}: put the overrides into the spec's entrypoint instead")
    inserts: dict[int, list[str]] = {}
    for item in overrides:
        if _SHELL_REF.search(item):
            raise ConfigError(
                f"--set {redact_text(item)}: a $VARIABLE in a --set value reaches the job as literal text "
                "(values are quoted, not expanded on the cluster): let your shell expand it (double "
                "quotes, not single), or write the reference into the spec's entrypoint")
        recipe, kv = recipes.scoped(item)
        targets = [c for c in calls if recipe is None or recipe in c.recipes]
        if not targets:
            raise ConfigError(f"--set {redact_text(item)}: the entrypoint runs no recipe {recipe!r}; "
                              f"its recipes: {', '.join(sorted({r for c in calls for r in c.recipes}))}")
        for c in targets:
            inserts.setdefault(c.end, []).append(item if recipe and len(c.recipes) > 1 else kv)
    for end in sorted(inserts, reverse=True):
        entrypoint = entrypoint[:end] + "".join(f" --set {shlex.quote(kv)}" for kv in inserts[end]) + entrypoint[end:]
    return entrypoint
