"""The operator's read of the routers' handoff parity reports (GET /internal/parity on every ready
router pod), for the HandoffVerified condition (tandem.operator.handoff_condition).

The same I/O rules as the KV health probe (tandem.operator.probe): plain HTTP to the pods the owner
chain names, all at once, each within the probe timeout and PARITY_MAX_BYTES, never inflated; an
answer is hostile until it parses as a report. Turned off with the KV probe (--no-kv-probe).
"""

from __future__ import annotations

import json

import aiohttp
from tandem.contracts.handoff_parity import PARITY_PATH, ParityReport
from tandem.contracts.names import pod_ready, pod_url
from tandem.operator.config import OperatorConfig
from tandem.operator.handoff_condition import RouterParity
from tandem.operator.probe import get_all
from tandem.operator.spec import ROUTER
from tandem.operator.status import Observation

PARITY_MAX_BYTES = 256 * 1024  # a report is about 1 KiB per worker


def _targets(obs: Observation) -> list[tuple[str, str]]:
    """(pod name, report URL) of every ready router pod."""
    ro = obs.roles.get(ROUTER)
    out = []
    for pod in ro.pods if ro else []:
        url = pod_url(pod)
        if url is not None and pod_ready(pod):
            out.append((pod["metadata"]["name"], url + PARITY_PATH))
    return sorted(out)


def _parse(pod: str, url: str, body: str | None, error: str | None) -> RouterParity:
    if body is None:
        return RouterParity(pod, error=error)
    try:
        return RouterParity(pod, ParityReport.from_dict(json.loads(body)))
    except (TypeError, ValueError, KeyError, AttributeError):
        return RouterParity(pod, error=f"{url} answered no parity report")


async def read_routers(obs: Observation, config: OperatorConfig,
                       session: aiohttp.ClientSession | None = None) -> list[RouterParity] | None:
    """Every ready router's report, or why it could not be read; None when probing is turned off."""
    if not config.kv_probe:
        return None
    found = _targets(obs)
    answers = await get_all([url for _, url in found], config.kv_probe_timeout_s, PARITY_MAX_BYTES, session)
    return [_parse(pod, url, body, error) for (pod, url), (body, error) in zip(found, answers, strict=True)]
