"""The one thread that talks to a NIXL agent: calls in order, and the polling between them.

Why a thread: the agent runs without NIXL's listener thread, so it is not thread-safe
(NIXL_THREAD_SYNC_NONE), and several of its calls can block: registering the pool pins it,
adding or removing a remote agent opens or closes UCX endpoints (which waits on a peer that
does not answer), aborting an unfinished READ and tearing the agent down flush. None of that may
stall the event loop that serves HTTP. So every agent call is submitted here and awaited there,
and the thread, between calls, also does the polling that used to cost the loop a wake-up each
time: transfers in flight (check_xfer_state, backing off from 0.2 ms to 2 ms) and, on a worker
that serves KV, completion notifications (get_new_notifs, every `poll_interval()` seconds);
notifications go back to the loop through call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_FIRST_CHECK_S = 0.0002
_MAX_CHECK_S = 0.002
_MAX_WAIT_S = 0.05  # the longest the thread sleeps, so stop() and a changed interval take effect


class _Watch:
    __slots__ = ("handle", "future", "due", "delay")

    def __init__(self, handle: Any, future: concurrent.futures.Future):
        self.handle = handle
        self.future = future
        self.delay = _FIRST_CHECK_S
        self.due = time.monotonic() + self.delay


class AgentThread:
    """Owns a NIXL agent once `agent` is set (from a call running here); see the module docstring."""

    def __init__(self, name: str, poll_interval: Callable[[], float] | None = None,
                 on_notifs: Callable[[dict[str, list[bytes]]], None] | None = None):
        self.agent: Any = None  # set and used only on the thread
        self._poll_interval = poll_interval
        self._on_notifs = on_notifs
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._watches: list[_Watch] = []
        self._next_poll = 0.0
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._loop is not None

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """fn(*args) on the thread, after the calls before it."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, args, fut))
        return fut

    def wake(self) -> None:
        """Poll now (a READ is coming: the notification interval just got shorter)."""
        self._next_poll = 0.0
        self._calls.put(None)

    def watch(self, handle: Any) -> concurrent.futures.Future:
        """A future for the final state ("DONE" or "ERR") of a posted transfer. Only from the thread."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()
        self._watches.append(_Watch(handle, fut))
        return fut

    def unwatch(self, handle: Any) -> None:
        """Stop checking a transfer (before releasing it). Only from the thread."""
        self._watches = [w for w in self._watches if w.handle is not handle]

    def stop(self) -> None:
        self._stopping = True
        self._calls.put(None)

    # --- the thread ---------------------------------------------------------------------------

    def _timeout(self, now: float) -> float:
        due = [w.due for w in self._watches]
        if self.agent is not None and self._poll_interval is not None:
            due.append(self._next_poll)
        return max(0.0, min([now + _MAX_WAIT_S, *due]) - now)

    def _run(self) -> None:
        while not self._stopping:
            try:
                item = self._calls.get(timeout=self._timeout(time.monotonic()))
            except queue.Empty:
                item = None
            if item is not None:
                fn, args, fut = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as e:  # noqa: BLE001 - handed to the awaiting side
                        fut.set_exception(e)
            if self.agent is None:
                continue
            try:
                self._check_transfers()
                self._poll_notifs()
            except Exception:  # noqa: BLE001 - polling must go on for every later transfer
                log.exception("polling the NIXL agent failed")

    def _check_transfers(self) -> None:
        now = time.monotonic()
        for w in list(self._watches):
            if w.due > now:
                continue
            try:
                state = self.agent.check_xfer_state(w.handle)
            except Exception as e:  # noqa: BLE001 - e.g. nixlRemoteDisconnectError: the peer died
                self._watches.remove(w)
                w.future.set_exception(e)
                continue
            if state == "PROC":
                w.delay = min(w.delay * 2, _MAX_CHECK_S)
                w.due = now + w.delay
            else:
                self._watches.remove(w)
                w.future.set_result(state)

    def _poll_notifs(self) -> None:
        if self._poll_interval is None or self._on_notifs is None or time.monotonic() < self._next_poll:
            return
        notifs = self.agent.get_new_notifs()
        self._next_poll = time.monotonic() + self._poll_interval()
        if notifs and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._on_notifs, notifs)
            except RuntimeError:  # the loop is closed: nobody is left to free blocks for
                pass
