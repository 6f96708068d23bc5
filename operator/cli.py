"""`tandem operator`: runs the kopf operator for InferenceServices.

Cheap to import (the CLI table imports it for --help): kopf and the kubernetes client load in run().
Deploy exactly one replica (Deployment strategy Recreate): kopf runs standalone, without peering.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from tandem.operator.config import DEFAULT_RESYNC_SECONDS, OperatorConfig, split_image


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=[],
        help="watch this namespace (repeatable; default: $TANDEM_NAMESPACES, comma-separated)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument(
        "--log-format", choices=["plain", "full", "json"], default=os.environ.get("TANDEM_LOG_FORMAT", "full"),
        help="log line format (json: one JSON object per line)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--liveness", default=os.environ.get("TANDEM_LIVENESS"), metavar="URL",
        help="serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument(
        "--worker-image", default=os.environ.get("TANDEM_WORKER_IMAGE", ""), metavar="REPO[:TAG]",
        help="image for workers and router when the InferenceService sets none ($TANDEM_WORKER_IMAGE)",
    )
    parser.add_argument(
        "--image-pull-policy", choices=["Always", "IfNotPresent", "Never"],
        default=os.environ.get("TANDEM_IMAGE_PULL_POLICY") or None,
        help="pull policy when the InferenceService sets none ($TANDEM_IMAGE_PULL_POLICY)",
    )
    parser.add_argument(
        "--resync-seconds", type=float,
        default=float(os.environ.get("TANDEM_RESYNC_SECONDS") or DEFAULT_RESYNC_SECONDS),
        help="period of the drift-correcting re-apply of every InferenceService",
    )
    parser.add_argument(
        "--no-kv-probe", dest="kv_probe", action="store_false", default=None,
        help="do not probe the workers' /internal/kv/health (KVTransferReady stays Unknown/NotProbed;"
        " $TANDEM_KV_PROBE=0)",
    )
    parser.add_argument(
        "--kv-probe-timeout-seconds", type=float, default=None, metavar="S",
        help="time limit of one worker's KV health probe ($TANDEM_KV_PROBE_TIMEOUT_SECONDS, default 3)",
    )
    parser.add_argument(
        "--metrics-timeout-seconds", type=float, default=None, metavar="S",
        help="time limit of the planner's GET of one pod's /metrics ($TANDEM_METRICS_TIMEOUT_SECONDS, default 3)",
    )
    parser.add_argument(
        "--workers", type=int, default=int(os.environ.get("TANDEM_OPERATOR_WORKERS") or 8), metavar="N",
        help="passes over different InferenceServices that may run at once ($TANDEM_OPERATOR_WORKERS, default 8)",
    )


def operator_config(args: argparse.Namespace) -> OperatorConfig:
    """Flags over environment over built-in defaults (what no flag sets, e.g. the operator pod's own
    namespace and labels, comes from the environment)."""
    base = OperatorConfig.from_env()
    repo, tag = split_image(args.worker_image)
    return dataclasses.replace(
        base,
        image_repository=repo or base.image_repository,
        image_tag=tag or base.image_tag,
        pull_policy=args.image_pull_policy or base.pull_policy,
        resync_seconds=args.resync_seconds,
        kv_probe=base.kv_probe if args.kv_probe is None else args.kv_probe,
        kv_probe_timeout_s=args.kv_probe_timeout_seconds or base.kv_probe_timeout_s,
        metrics_timeout_s=args.metrics_timeout_seconds or base.metrics_timeout_s,
    )


def run(args: argparse.Namespace) -> int:
    import kopf
    from tandem.operator import handlers  # noqa: F401  (registers the handlers)

    namespaces = list(args.namespace) or [
        n for n in os.environ.get("TANDEM_NAMESPACES", "").split(",") if n
    ]
    if not namespaces and not args.all_namespaces:
        raise SystemExit("tandem operator: give --namespace NS (repeatable) or --all-namespaces")
    log_format = {"plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL, "json": kopf.LogFormat.JSON}
    kopf.configure(verbose=args.verbose, log_format=log_format[args.log_format])
    if not args.verbose:
        # Every event runs a handler that only queues work; one "succeeded" line each is noise.
        logging.getLogger("kopf.objects").addFilter(
            lambda record: not record.getMessage().startswith(("Handler 'child_changed'",
                                                                "Handler 'service_changed'"))
        )
    memo = kopf.Memo(config=operator_config(args), workers=max(1, args.workers))
    kopf.run(
        standalone=True,
        clusterwide=args.all_namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness,
        memo=memo,
    )
    return 0


if __name__ == "__main__":
    import sys

    _parser = argparse.ArgumentParser(prog="tandem operator")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
