"""The ``padless`` command (also ``python -m padless``).

    padless inspect PATH [--batch-size B | --budget T] [--attention] [--plot FILE] [--json]

Subcommands live in their own modules (``padless/cli/inspect.py``) and add their parser
here. Mistakes in what a command was asked to do (a missing path, an unknown format)
print one line naming them and exit with status 2; other errors keep their traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from padless.cli.sources import InspectError

__all__ = ["InspectError", "main", "parser"]


def parser() -> argparse.ArgumentParser:
    from padless.cli import inspect

    p = argparse.ArgumentParser(prog="padless", description="padless: remove padding from PyTorch.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    inspect.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    p = parser()
    args = p.parse_args(argv)
    if args.command is None:
        p.print_help()
        return 0
    try:
        return args.run(args)
    except InspectError as e:  # the message names the command
        print(e, file=sys.stderr)
        return 2
    except (FileNotFoundError, ImportError) as e:  # an optional package: the message names the extra
        print(f"padless {args.command}: {e}", file=sys.stderr)
        return 2
