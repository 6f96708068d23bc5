"""`tandem operator`: runs the kopf operator for InferenceServices.

Cheap to import (the CLI table imports it for --help): kopf and the kubernetes client load in run().
Several replicas elect a leader with --leader-election (tandem.operator.leader); without it, run one.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from tandem.operator.config import DEFAULT_RESYNC_SECONDS, OperatorConfig, split_image
from tandem.operator.election import ElectionConfig
from tandem.operator.policy import POLICY_ENV, Policy, PolicyError


def _env_flag(name: str) -> bool:
    return (os.environ.get(name) or "").strip().lower() in ("1", "true", "yes", "on")


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
        help="image for prefill and decode workers when the InferenceService sets none ($TANDEM_WORKER_IMAGE)",
    )
    parser.add_argument(
        "--router-image", default=os.environ.get("TANDEM_ROUTER_IMAGE", ""), metavar="REPO[:TAG]",
        help="image for routers when the InferenceService sets no router.image ($TANDEM_ROUTER_IMAGE)",
    )
    parser.add_argument(
        "--vllm-image", default=os.environ.get("TANDEM_VLLM_IMAGE", ""), metavar="REPO[:TAG]",
        help="image for runtime vllm's prefill and decode workers when the InferenceService sets no "
        "runtime.image ($TANDEM_VLLM_IMAGE)",
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
        help="do not read the routers' reports of their workers' KV health and handoff parity"
        " (KVTransferReady stays Unknown/NotProbed; $TANDEM_KV_PROBE=0)",
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
        "--mark-pods-for-removal", dest="mark_pods", action="store_true", default=None,
        help="before a scale-down, give the pods the planner chose the lowest pod-deletion-cost so the"
        " ReplicaSet removes those; needs `pods: patch` in their namespaces ($TANDEM_MARK_PODS_FOR_REMOVAL=1)",
    )
    _add_policy(parser)
    election = parser.add_argument_group("leader election (two or more replicas: one leads, the others stand by)")
    election.add_argument(
        "--leader-election", action="store_true", default=_env_flag("TANDEM_LEADER_ELECTION"),
        help="run kopf only while holding a coordination.k8s.io Lease ($TANDEM_LEADER_ELECTION=1)",
    )
    election.add_argument(
        "--leader-election-namespace", default=os.environ.get("TANDEM_LEADER_ELECTION_NAMESPACE"), metavar="NS",
        help="the Lease's namespace (default: $POD_NAMESPACE, the operator's own)",
    )
    election.add_argument("--leader-election-name", default="tandem-operator", metavar="NAME", help="the Lease's name")
    election.add_argument("--lease-duration-seconds", type=int, default=15, metavar="S",
                          help="a standby takes an unrenewed Lease after this long (default 15)")
    election.add_argument("--lease-renew-deadline-seconds", type=float, default=10.0, metavar="S",
                          help="a leader that could not renew for this long exits (default 10)")
    election.add_argument("--lease-retry-seconds", type=float, default=2.0, metavar="S",
                          help="renew, or try to acquire, this often (default 2)")
    parser.add_argument(
        "--workers", type=int, default=int(os.environ.get("TANDEM_OPERATOR_WORKERS") or 16), metavar="N",
        help="passes over different InferenceServices that may run at once ($TANDEM_OPERATOR_WORKERS, default 16)",
    )


def _add_policy(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy", default=None, metavar="JSON",
        help="what an InferenceService may ask of a node, per namespace: allowed hostPath prefixes, images,"
        " ServiceAccounts, hostNetwork, ipcLock, alwaysPullImages (docs/install.md; $TANDEM_POLICY; default:"
        " none of it, only the operator's own images)",
    )


def operator_config(args: argparse.Namespace) -> OperatorConfig:
    """Flags over environment over built-in defaults (what no flag sets, e.g. the operator pod's own
    namespace and labels, comes from the environment)."""
    try:
        base = OperatorConfig.from_env()
        policy = base.policy if args.policy is None else Policy.from_json(args.policy)
    except PolicyError as e:
        raise SystemExit(f"tandem operator: --policy / ${POLICY_ENV}: {e}") from None
    repo, tag = split_image(args.worker_image)
    router_repo, router_tag = split_image(args.router_image)
    vllm_repo, vllm_tag = split_image(args.vllm_image)
    return dataclasses.replace(
        base,
        image_repository=repo or base.image_repository,
        image_tag=tag or base.image_tag,
        router_repository=router_repo or base.router_repository,
        router_tag=router_tag or base.router_tag,
        vllm_repository=vllm_repo or base.vllm_repository,
        vllm_tag=vllm_tag or base.vllm_tag,
        pull_policy=args.image_pull_policy or base.pull_policy,
        resync_seconds=args.resync_seconds,
        kv_probe=base.kv_probe if args.kv_probe is None else args.kv_probe,
        kv_probe_timeout_s=args.kv_probe_timeout_seconds or base.kv_probe_timeout_s,
        metrics_timeout_s=args.metrics_timeout_seconds or base.metrics_timeout_s,
        mark_pods=base.mark_pods if args.mark_pods is None else args.mark_pods,
        policy=policy,
    )


def run(args: argparse.Namespace) -> int:
    import asyncio

    import kopf
    from tandem.operator import handlers, process  # noqa: F401  (handlers registers the handlers)

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
            lambda record: not record.getMessage().startswith(("Handler 'changed_",  # handlers.child_changed
                                                                "Handler 'service_changed'"))
        )
    memo = kopf.Memo(config=operator_config(args), workers=max(1, args.workers))
    kopf_kwargs = {"clusterwide": args.all_namespaces, "namespaces": namespaces, "memo": memo}
    return asyncio.run(process.serve(args.liveness, election_config(args), kopf_kwargs))


def election_config(args: argparse.Namespace) -> ElectionConfig | None:
    """The Lease to elect a leader on, or None without --leader-election."""
    if not args.leader_election:
        return None
    namespace = args.leader_election_namespace or os.environ.get("POD_NAMESPACE")
    if not namespace:
        raise SystemExit("tandem operator: --leader-election needs --leader-election-namespace or $POD_NAMESPACE")
    try:
        return ElectionConfig(namespace, args.leader_election_name, args.lease_duration_seconds,
                              args.lease_renew_deadline_seconds, args.lease_retry_seconds)
    except ValueError as e:
        raise SystemExit(f"tandem operator: {e}") from None


if __name__ == "__main__":
    import sys

    _parser = argparse.ArgumentParser(prog="tandem operator")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
