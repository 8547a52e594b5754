"""How a question's package names its ``gpumesh bench`` commands.

A package of the lab (``overhead``, ``locality``, ...) declares ``QUESTION`` (one line: what it
answers) and ``COMMANDS``; ``gpumesh bench`` imports a command's module only to add its
arguments or to run it. Two kinds of module:

- ``add_arguments(parser)`` + ``main(namespace) -> int`` (the default; ``arguments`` and
  ``function`` name others where one module holds several commands);
- ``main(argv) -> int`` that parses its own arguments (``own_args=True``; also run as
  ``python -m MODULE``): ``gpumesh bench NAME ...`` hands it the arguments unparsed.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    module: str
    function: str = "main"
    arguments: str = "add_arguments"
    own_args: bool = False

    def target(self) -> Callable[..., int]:
        fn: Callable[..., int] = getattr(importlib.import_module(self.module), self.function)
        return fn

    def add_to(self, sub: argparse._SubParsersAction) -> None:
        """Adds this command to ``gpumesh bench``'s parser (an own-arguments command only by
        name: :func:`gpumesh_bench.cli.main` hands it its arguments before parsing)."""
        if self.own_args:
            sub.add_parser(self.name, add_help=False)
            return
        p = sub.add_parser(self.name, description=self.help,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        getattr(importlib.import_module(self.module), self.arguments)(p)
