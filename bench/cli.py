"""``gpumesh bench``: the lab's questions, each a package with its commands.

``gpumesh bench --help`` lists them; ``gpumesh bench COMMAND --help`` gives a command's
arguments. The fleet simulator is its own command, ``gpumesh sim`` (``gpumesh_bench.sim``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from collections.abc import Sequence

from gpumesh_bench.commands import Command

#: The packages (or modules) of the lab, one per question, in the order ``--help`` lists them.
QUESTIONS = ("load", "overhead", "policies", "locality", "peers", "reliability", "gpu")


def _questions() -> list[tuple[str, str, tuple[Command, ...]]]:
    out: list[tuple[str, str, tuple[Command, ...]]] = []
    for name in QUESTIONS:
        mod = importlib.import_module(f"gpumesh_bench.{name}")
        out.append((name, mod.QUESTION, mod.COMMANDS))
    return out


def _listing(questions: list[tuple[str, str, tuple[Command, ...]]]) -> str:
    lines = ["questions and their commands:"]
    for name, question, commands in questions:
        lines += ["", f"{name}: {question}"]
        lines += [textwrap.fill(c.help, 100, initial_indent=f"  {c.name:17s} ",
                                subsequent_indent=" " * 20) for c in commands]
    lines += ["", "sim: routing policies in the virtual-time fleet simulator, and its fidelity "
                  "check against live engines", "  see 'gpumesh sim --help'"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    questions = _questions()
    p = argparse.ArgumentParser(prog="gpumesh bench", description=__doc__,
                                epilog=_listing(questions),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True,
                             help="one of the commands listed below")
    for _, _, commands in questions:
        for c in commands:
            c.add_to(sub)
    return p


def _command(name: str) -> Command | None:
    for _, _, commands in _questions():
        for c in commands:
            if c.name == name:
                return c
    return None


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``gpumesh bench`` to the ``gpumesh`` command line (the ``gpumesh.commands`` entry
    point); the arguments after ``bench`` go to :func:`main` unparsed."""
    b = sub.add_parser("bench", help="the benchmark lab: load, overhead, policies, locality, "
                                     "peers, reliability, GPU", add_help=False)
    # argparse hands a leading option to no REMAINDER positional: `bench --help` is its own flag
    b.add_argument("-h", "--help", action="store_true", dest="bench_help")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=lambda a: main((["--help"] if a.bench_help else []) + a.rest))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    own = _command(args[0]) if args else None
    if own is not None and own.own_args:   # it parses its own arguments: they go unparsed
        return own.target()(args[1:])
    # the namespace holds only arguments (benchmarks record it in their results)
    a = build_parser().parse_args(args)
    command = _command(a.cmd)
    assert command is not None
    rc: int = command.target()(a)
    return rc


if __name__ == "__main__":
    sys.exit(main())
