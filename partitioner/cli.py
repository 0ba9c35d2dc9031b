"""The ``partitioner`` command line.

Each sub-command lives in its own module under :mod:`partitioner.commands` and exposes
``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``. Modules import heavy
dependencies (TVM, ONNX Runtime) inside ``run`` so that ``--help`` stays fast.

Exit codes: 0 ok, 1 run failed or mismatch, 2 bad input or usage. A :class:`PartitionerError`
becomes one line on stderr; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import traceback

from partitioner.core.errors import PartitionerError


def _command_modules() -> list:
    import partitioner.commands as pkg

    mods = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"partitioner.commands.{info.name}")
        if hasattr(mod, "add_arguments") and hasattr(mod, "run"):
            mods.append(mod)
    return mods


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # exit 2 with one line, as argparse does, but no usage dump
        sys.stderr.write(f"partitioner: error: {message}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="partitioner", description="ONNX graph compiler and auto-partitioner.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    from partitioner import __version__

    parser.add_argument("--version", action="version", version=f"partitioner {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for mod in _command_modules():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    debug = getattr(args, "debug", False)
    try:
        return int(args._run(args) or 0)
    except PartitionerError as exc:
        if debug:
            traceback.print_exc()
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        sys.stderr.write(f"partitioner: error: {msg}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("partitioner: interrupted\n")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
