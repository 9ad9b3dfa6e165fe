"""Check command lines against their own parsers without running them (a dry run's check).

    python -m pdserve.argcheck "pdserve bench compare --deployment 'a=pdserve up --port {port}' ..." \\
                                     "python -m pdserve.bench.kernel_bench --num-heads 9" ...

Each argument is one command line, as a shell would split it (a leading `timeout N` and `VAR=value`
assignments are skipped). `pdserve ...` and `python -m pdserve[.cli] ...` are parsed by the
`pdserve` command's parser, and the deployments of `pdserve bench compare` by it too;
`python -m pdserve.bench.NAME ...` by that module's `parse_args`; `python -m pytest ...` has its
test paths checked. Exits 1 naming each command that does not parse.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


class CommandError(ValueError):
    """A command line its parser refuses; the message is the parser's."""


def _strip(argv: list[str]) -> list[str]:
    """Without a leading `timeout [-k S] N` and environment assignments."""
    while argv:
        if _ASSIGNMENT.match(argv[0]):
            argv = argv[1:]
        elif argv[0] == "timeout":
            argv = argv[1:]
            while argv and argv[0].startswith("-"):
                argv = argv[2:] if argv[0] in ("-k", "-s") else argv[1:]
            argv = argv[1:]  # the duration
        else:
            return argv
    return argv


def _parse(parse, args: list[str], command: str) -> argparse.Namespace:
    """`parse(args)`, its error as a CommandError rather than an exit."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parse(args)
    except SystemExit as exc:
        if exc.code in (0, None):
            return argparse.Namespace()
        raise CommandError(f"{command}: {err.getvalue().strip().splitlines()[-1] if err.getvalue() else exc}") from None


def check(command: str) -> None:
    """Raise CommandError unless `command` parses (see the module docstring)."""
    argv = _strip(shlex.split(command))
    if not argv:
        raise CommandError(f"{command!r}: no command")
    if Path(argv[0]).name == "pdserve":
        return _check_pdserve(argv[1:], command)
    if len(argv) < 3 or argv[1] != "-m":
        raise CommandError(f"{command}: expected `pdserve ...` or `python -m MODULE ...`")
    module, args = argv[2], argv[3:]
    if module in ("pdserve", "pdserve.cli"):
        return _check_pdserve(args, command)
    if module == "pytest":
        missing = [a.split("::")[0] for a in args if a.startswith("tests/") and not Path(a.split("::")[0]).exists()]
        if missing:
            raise CommandError(f"{command}: no {', '.join(missing)}")
        return None
    if not module.startswith("pdserve.bench."):
        raise CommandError(f"{command}: {module} is not a module this check knows")
    parse_args = getattr(importlib.import_module(module), "parse_args", None)
    if parse_args is None:
        raise CommandError(f"{command}: {module} has no parse_args")
    _parse(parse_args, args, command)
    return None


def _check_pdserve(args: list[str], command: str) -> None:
    from pdserve.bench.compare import Deployment
    from pdserve.cli import build_parser

    parsed = _parse(build_parser().parse_args, args, command)
    for text in getattr(parsed, "deployment", None) or ():
        try:
            deployment = Deployment.parse(text)
        except ValueError as exc:
            raise CommandError(f"{command}: {exc}") from None
        check(shlex.join(deployment.argv(0)))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.argcheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("commands", nargs="+", metavar="COMMAND", help="one command line each")
    bad = []
    for command in p.parse_args(argv).commands:
        try:
            check(command)
        except CommandError as exc:
            bad.append(str(exc))
    for line in bad:
        print(f"does not parse: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
