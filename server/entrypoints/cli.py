"""The `iterserve` command: one subcommand per job (generate, serve, bench, operator, router)."""

from __future__ import annotations

import argparse
import sys

from iterserve.bench import cli as bench_cli
from iterserve.operator import cli as operator_cli
from iterserve.router import cli as router_cli
from iterserve.server.entrypoints import extras, generate_cmd, serve_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iterserve", description="Continuous-batching LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    generate_cmd.register(sub)
    serve_cmd.register(sub)
    bench_cli.register(sub)
    operator_cli.register(sub)
    router_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    extra = extras.COMMAND_EXTRAS[args.command]
    absent = extras.missing(extra)
    if absent:  # before any import of them, so the user reads what to install, not a traceback
        print(f"iterserve {args.command}: {', '.join(absent)} not installed: pip install 'iterserve[{extra}]'",
              file=sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
