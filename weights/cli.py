"""`tandem model`: what the pods run to get a hub model's weights before a worker starts.

  tandem model download --hub ORG/NAME --revision COMMIT --dest DIR
      every file at that commit into DIR, once (a complete DIR is left as it is; pods sharing a
      node's cache wait for the first); the download Job and the download init containers run it
  tandem model wait --dir DIR [--timeout-seconds N]
      until DIR is complete (the worker's init container, while the download Job fills the PVC)

The token of a gated model comes from $HF_TOKEN (a secretKeyRef), the hub from $HF_ENDPOINT;
neither is ever printed. A failure prints one line saying why, which becomes the container's
termination message (terminationMessagePolicy: FallbackToLogsOnError), and exits EXIT_PERMANENT when
trying again cannot help (gated, not found: the download Job's podFailurePolicy fails the Job at once)
or 1 when it may (the hub unreachable, a broken connection, a full disk).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_PERMANENT = 3  # a gated repo, or a repo, revision or file that does not exist


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    down = sub.add_parser("download", help="download a hub model's files at a commit into a folder, once")
    down.add_argument("--hub", required=True, help="the hub id, org/name")
    down.add_argument("--revision", required=True, help="the commit (or a branch or tag) to download")
    down.add_argument("--dest", required=True, type=Path, help="the folder to fill")
    wait = sub.add_parser("wait", help="wait until another process has downloaded a folder")
    wait.add_argument("--dir", required=True, type=Path, help="the folder a download Job fills")
    wait.add_argument("--timeout-seconds", type=float, default=3600.0)


def run(args: argparse.Namespace) -> int:
    from tandem.weights.hub import PERMANENT, HubError, download, endpoint_from_env, wait_complete

    try:
        if args.action == "download":
            token = os.environ.get("HF_TOKEN") or None
            dest = download(args.hub, args.revision, args.dest, endpoint=endpoint_from_env(), token=token)
            print(f"tandem model: {args.hub}@{args.revision} is complete in {dest}", flush=True)
        else:
            wait_complete(args.dir, args.timeout_seconds)
            print(f"tandem model: {args.dir} is complete", flush=True)
    except (HubError, TimeoutError, OSError) as e:
        # One line (a library's message may span several): the last line of the log is the reason.
        print(f"tandem model {args.action}: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return EXIT_PERMANENT if isinstance(e, HubError) and e.reason in PERMANENT else 1
    return 0
