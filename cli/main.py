"""The `tandem` command.

Each subcommand lives in its own module, imported only when chosen, so
`tandem --help` (and the operator and router) never load torch. A module
listed here must be cheap to import: it defines `add_arguments(parser)` and
`run(args) -> int`, and imports heavy things inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Order is the order shown in --help.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("tandem.worker.local.up", "run a router, prefill and decode workers locally"),
    "worker": ("tandem.worker.server.cli", "run one model worker (prefill, decode or colocated)"),
    "router": ("tandem.router.cli", "run the OpenAI-compatible router"),
    "operator": ("tandem.operator.cli", "run the Kubernetes operator (kopf)"),
    "plan": ("tandem.cli.plan", "how many prefill and decode workers a workload needs, from measurements"),
    "model": ("tandem.weights.cli", "download a hub model's weights once (what download Jobs and init containers run)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Prefill/decode disaggregated LLM serving on Kubernetes.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
