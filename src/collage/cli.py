"""The ``collage`` command line.

Subcommands live next to the code they drive; each such module exposes
``register(subparsers)`` which adds its parsers and sets ``func`` on them. This module sits
on top of them: it imports them, never the reverse. Errors that a user can fix (bad flags,
unreadable files, impossible sizes: :class:`collage.errors.UsageError`) are printed as one
line, with exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import __version__
from .bench import register as register_bench
from .errors import UsageError
from .train.commands import register as register_train

#: What adds the subcommands, in the order of ``collage --help``.
REGISTRARS = (register_train, register_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="collage",
        description="Train in pure bf16 without fp32 master weights: compare precision "
        "strategies, estimate memory, benchmark optimizers.",
    )
    parser.add_argument("--version", action="version", version=f"collage {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in REGISTRARS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to re-run under a launcher
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a reader that left is caught (below)
        return code
    except (UsageError, FileNotFoundError, PermissionError, IsADirectoryError) as error:
        print(f"collage {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"collage {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`collage ... | head`): stop quietly, as a
        # Unix tool does; stdout goes to devnull so that Python's own flush at exit does not
        # fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE


if __name__ == "__main__":
    raise SystemExit(main())
