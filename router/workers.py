"""The router's live view of its workers: who exists (from discovery) and how loaded each is.

Discovery says which URLs exist and whether their pods are ready; a poll of each worker's
/internal/info every `poll_interval_s` adds its role, kv_compat and load. A request that fails
on a worker marks it unusable at once; the next successful poll brings it back. A poll that is
refused or answered wrongly does the same; one that only times out (a worker too busy to answer in
time, as a loaded vLLM's /metrics can be) keeps the worker as last polled for `slow_poll_grace_s`
after its last good poll, so one slow answer never turns every request away with 503. Between polls the
set adds what this router's requests put on each worker (`account`: each journey's charges) and
keeps the round-robin cursor; `snapshot` freezes all of it, with the prefix index's answer for one
request, for a pure decision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from tandem.contracts.handoff_parity import ParityState
from tandem.contracts.kv_health import KVHealth
from tandem.contracts.names import Role
from tandem.contracts.protocol import WorkerInfo
from tandem.router.journey import Charge
from tandem.router.policies.base import RequestInfo, Snapshot, WorkerView
from tandem.router.prefix_index import PrefixIndex
from tandem.router.worker_client import WorkerClient, WorkerFailed

log = logging.getLogger("tandem.router.workers")


@dataclass(frozen=True)
class Target:
    """One worker as discovery reports it."""

    url: str
    role: Role | None = None  # None: learn it from /internal/info
    kv_compat: str | None = None  # the tandem.dev/kv-compat label, when discovery knows it
    ready: bool = True  # pod readiness (static discovery: always true)


@dataclass
class _Entry:
    target: Target
    first_seen: float
    info: WorkerInfo | None = None
    failed: bool = False  # a request failed here since the last good poll
    router_inflight: int = 0
    router_prompt_tokens: int = 0
    router_planned: int = 0  # sequences planned here whose prompts are still being prefilled elsewhere
    last_error: str = ""
    polls: int = 0  # polls started: a request assigned before one started may be in its report
    info_poll: int = 0  # the poll the current info came from
    last_good: float = 0.0  # monotonic time of the last poll that answered
    finished_in_report: int = 0  # prompt tokens this router saw finish that `info` still counts

    def view(self, parity: Callable[[str], ParityState | None] | None = None) -> WorkerView:
        info = self.info
        role = info.role if info else self.target.role
        gen = self.target.kv_compat if self.target.kv_compat is not None else (info.kv_compat if info else "")
        return WorkerView(
            url=self.target.url,
            role=role if role is not None else Role.DECODE,
            kv_compat=gen,
            ready=bool(self.target.ready and info is not None and info.ready and not self.failed and role),
            first_seen=self.first_seen,
            running=info.running if info else 0,
            waiting=info.waiting if info else 0,
            kv_usage=info.kv_usage if info else 0.0,
            outstanding_prompt_tokens=max(0, info.outstanding_prompt_tokens - self.finished_in_report) if info else 0,
            router_inflight=self.router_inflight,
            router_planned=self.router_planned,
            router_prompt_tokens=self.router_prompt_tokens,
            tokenizer_sha256=info.tokenizer_sha256 if info else "",
            dtype=info.dtype if info else "",
            engine_id=info.engine_id if info else "",
            parity=parity(self.target.url) if parity is not None else None,
        )


@dataclass
class WorkerSet:
    """Every worker this router knows and how loaded each is (in the engine, a "pool" is the KV
    tensor; here it is a set of worker processes)."""

    client: WorkerClient
    poll_interval_s: float = 0.5
    slow_poll_grace_s: float = 10.0  # how long polls that time out keep a worker as last polled
    served_model: str | None = None  # fixed by configuration, else learnt from the workers
    # called with the views after every poll (the tokenizer check)
    listeners: list[Callable[[list[WorkerView]], None]] = field(default_factory=list)
    # each worker's standing from the handoff parity probe (router/parity/checker.py); None: no probe
    parity: Callable[[str], ParityState | None] | None = None
    # which worker holds which prefix-cache blocks (a policy that uses_prefix_index); None: not kept
    prefix_index: PrefixIndex | None = None
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _turns: Counter[Role] = field(default_factory=Counter)  # choices made per pool: the round-robin cursor
    # request id -> url -> (what it counts there, the poll count when that was sent)
    _charged: dict[str, dict[str, tuple[Charge, int]]] = field(default_factory=dict)

    def set_targets(self, targets: list[Target]) -> None:
        """Replace the set of workers (called by discovery on every change)."""
        new = {t.url: t for t in targets}
        for url in list(self._entries):
            if url not in new:
                log.info("worker removed: %s", url)
                del self._entries[url]
        for url, t in new.items():
            e = self._entries.get(url)
            if e is None:
                log.info("worker added: %s (role %s)", url, t.role)
                self._entries[url] = _Entry(target=t, first_seen=time.monotonic())
            else:
                e.target = t
        self._changed.set()

    def urls(self) -> list[str]:
        return list(self._entries)

    def views(self) -> list[WorkerView]:
        return [e.view(self.parity) for e in self._entries.values()]

    def kv_health(self) -> tuple[dict[str, KVHealth], dict[str, str]]:
        """Each worker's KV health as its last poll reported it (URL -> KVHealth), and why each worker
        whose last poll failed could not be asked (URL -> error): the router's report passes both on
        to the operator (ParityReport), which then never asks every worker itself."""
        health = {url: e.info.kv_health for url, e in self._entries.items()
                  if e.info is not None and e.info.kv_health is not None}
        unreachable = {url: e.last_error for url, e in self._entries.items() if e.info is None and e.failed}
        return health, unreachable

    def snapshot(self, request: RequestInfo | None = None) -> Snapshot:
        """Everything a policy may read, frozen now: the views, the prefix-cache tokens each worker
        holds of `request`, the round-robin cursor."""
        views = self.views()
        index = self.prefix_index
        cached = index.cached(request, [v.url for v in views]) if index is not None and request is not None else {}
        return Snapshot(tuple(views), cached, dict(self._turns))

    def took_turns(self, pools: Iterable[Role]) -> None:
        """The policy chose a worker in each of `pools`: the next choice there is the next one's turn."""
        self._turns.update(pools)

    def model(self) -> str | None:
        if self.served_model:
            return self.served_model
        for e in self._entries.values():
            if e.info is not None and e.info.model:  # a worker still loading reports ""
                return e.info.model
        return None

    def can_serve(self) -> bool:
        """A request can be served now: a decode or colocated worker is ready (prefill alone cannot)."""
        return any(v.ready and v.role is not Role.PREFILL for v in self.views())

    def listed_model(self) -> str | None:
        """The model /v1/models lists: only once a request for it can be served, so a client that waits
        for the list is not then answered 503 while the decode workers still load or compile."""
        return self.model() if self.can_serve() else None

    def max_model_len(self) -> int | None:
        """The smallest context length a ready worker reports (what any of them can serve)."""
        lens = [e.info.max_model_len for e in self._entries.values()
                if e.info is not None and e.info.ready and e.info.max_model_len > 0]
        return min(lens) if lens else None

    def report_failure(self, url: str, error: str) -> None:
        e = self._entries.get(url)
        if e is not None:
            e.failed = True
            e.last_error = error

    def account(self, request_id: str, charges: Mapping[str, Charge]) -> None:
        """Count what request `request_id` now puts on each worker (`Journey.charges`, which `decide`
        keeps; {} once it ended): new work added until the worker's own numbers catch up, work that
        ended taken off, a prompt that got its first token no longer queued (its call still open)."""
        before, now = self._charged.pop(request_id, {}), {}
        for url, (old, at) in before.items():
            new = charges.get(url)
            if new is not None and (new.inflight, new.planned) == (old.inflight, old.planned) \
                    and new.prompt_tokens <= old.prompt_tokens:
                self._done_waiting(url, old.prompt_tokens - new.prompt_tokens, at)
                now[url] = (new, at)
            else:
                self._count(url, old, -1)
                self._done_waiting(url, old.prompt_tokens, at)
        for url, new in charges.items():
            if url not in now:
                now[url] = (new, self._count(url, new, +1))
        if now:
            self._charged[request_id] = now

    def _count(self, url: str, charge: Charge, sign: int) -> int:
        """Add (+1) or take off (-1) a charge's sequences; returns the worker's poll count (when sent)."""
        e = self._entries.get(url)
        if e is None:
            return 0
        e.router_inflight = max(0, e.router_inflight + sign * charge.inflight)
        e.router_planned = max(0, e.router_planned + sign * charge.planned)
        if sign > 0:
            e.router_prompt_tokens += charge.prompt_tokens
        return e.polls

    def _done_waiting(self, url: str, prompt_tokens: int, assigned_at: int) -> None:
        """Prompt tokens no longer queued there. The worker's last report counts them too when it
        came from a poll started after they were sent: without taking them off it, a pool whose
        long prompt just finished looks saturated until the next poll."""
        e = self._entries.get(url)
        if e is None or not prompt_tokens:
            return
        e.router_prompt_tokens = max(0, e.router_prompt_tokens - prompt_tokens)
        if e.info_poll > assigned_at:
            e.finished_in_report += prompt_tokens

    async def _poll_one(self, e: _Entry) -> None:
        url = e.target.url
        e.polls += 1
        poll = e.polls
        try:
            info = await self.client.info(url, e.target.role)
        except WorkerFailed as exc:
            since = time.monotonic() - e.last_good
            if exc.slow and e.info is not None and not e.failed and since < self.slow_poll_grace_s:
                log.warning("worker %s slow to answer its poll (%s): kept as polled %.1f s ago", url, exc, since)
                e.last_error = str(exc)
                return
            if e.info is not None or not e.failed:
                log.warning("worker %s unreachable: %s", url, exc)
            e.info, e.failed, e.last_error = None, True, str(exc)
            return
        if e.info is None:
            log.info("worker %s: role %s, model %s, ready %s", url, info.role, info.model, info.ready)
        e.info, e.failed, e.info_poll, e.finished_in_report = info, False, poll, 0
        e.last_good = time.monotonic()

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll_one(e) for e in list(self._entries.values())))
        views = self.views()
        for listener in self.listeners:
            listener(views)

    async def run(self) -> None:
        """Poll forever; a change of targets triggers a poll at once."""
        while True:
            await self.poll_once()
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), self.poll_interval_s)
            except TimeoutError:
                pass
