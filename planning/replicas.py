"""The simulated replicas: a prefill replica serves prompts one at a time (FIFO); a decode replica
runs continuous batching as a fluid: between two events every running sequence advances at one
token per step, a step taking Capacity.step_s(n). A decode replica that prefills a prompt itself
either stalls its streams for the whole prompt or, with a chunk size, prefills it a chunk per step
beside them (each such step costs Capacity.chunk_step_s). Each keeps the counters a real worker
exports, so the simulator can hand the planner the readings it reads in production.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque

from tandem.planning.autoscaling.scrape import Histogram, WorkerReading
from tandem.planning.capacity import Capacity
from tandem.planning.workload import Request

STARTING, READY, DRAINING = "starting", "ready", "draining"
KV_BLOCK = 16


class Hist:
    """A mutable Prometheus-style histogram (counts per bucket), frozen into a Histogram to read."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0.0] * len(bounds)
        self.sum = 0.0

    def add(self, value: float, n: float = 1.0) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def frozen(self) -> Histogram:
        return Histogram(self.bounds, tuple(itertools.accumulate(self.counts)), self.sum)


class Seq:
    """A request on a decode replica: `remaining` tokens still to generate."""

    __slots__ = ("req", "remaining", "v_end", "joined_v")

    def __init__(self, req: Request, remaining: float):
        self.req, self.remaining, self.v_end, self.joined_v = req, remaining, 0.0, 0.0


class Replica:
    __slots__ = ("name", "role", "state", "created", "version", "prompt_tokens", "gen_tokens", "busy_s",
                 "steps", "step_tokens")

    def __init__(self, name: str, role: str, created: float):
        self.name, self.role, self.state, self.created, self.version = name, role, STARTING, created, 0
        self.prompt_tokens = self.gen_tokens = self.busy_s = self.steps = self.step_tokens = 0.0


class PrefillReplica(Replica):
    __slots__ = ("queue", "current", "started", "outstanding")

    def __init__(self, name: str, created: float):
        super().__init__(name, "prefill", created)
        self.queue: deque[Request] = deque()
        self.current: Request | None = None
        self.started = 0.0
        self.outstanding = 0  # prompt tokens queued or being prefilled

    def load(self) -> int:
        return self.outstanding

    def idle(self) -> bool:
        return self.current is None and not self.queue

    def reading(self, now: float, export_outstanding: bool) -> WorkerReading:
        busy = self.busy_s + (now - self.started if self.current is not None else 0.0)
        return WorkerReading(running=1.0 if self.current else 0.0, waiting=float(len(self.queue)), leased=0.0,
                             kv_blocks_used=(self.current.prompt // KV_BLOCK if self.current else 0.0),
                             kv_blocks_total=4096.0, prompt_tokens=self.prompt_tokens,
                             generation_tokens=self.gen_tokens, busy_seconds=busy, steps=self.steps,
                             step_tokens=self.step_tokens,
                             outstanding_prompt_tokens=float(self.outstanding) if export_outstanding else None)


class DecodeReplica(Replica):
    """Continuous batching as a fluid: v counts the tokens each running sequence has made so far."""

    __slots__ = ("running", "v", "t_last", "local", "stall_end", "stall_req", "waiting", "kv_prompt", "kv_v",
                 "_ids", "kv_blocks_total", "chunk", "local_left")

    def __init__(self, name: str, created: float, kv_blocks_total: int = 4096, chunk: int | None = None):
        super().__init__(name, "decode", created)
        self.running: list[tuple[float, int, Seq]] = []  # heap by v_end
        self.v = 0.0
        self.t_last = created
        self.local: deque[Request] = deque()  # prompts to prefill here (no prefill replica)
        self.stall_end: float | None = None  # a whole-prompt local prefill: nothing decodes until then
        self.stall_req: Request | None = None  # the prompt being prefilled here
        self.chunk = chunk  # prompt tokens per step when prefilling beside the streams (None: whole)
        self.local_left = 0.0  # its tokens still to prefill (chunked)
        self.waiting: deque[Seq] = deque()  # prefilled, waiting for a seat
        self.kv_prompt = 0.0  # sum of the running sequences' prompt tokens
        self.kv_v = 0.0  # sum of v at which they joined (tokens made = n * v - kv_v)
        self._ids = itertools.count()
        self.kv_blocks_total = kv_blocks_total

    def load(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.local) + (self.stall_req is not None)

    def local_prompt_tokens(self) -> float:
        """Prompt tokens this replica still has to prefill itself (what a worker reports queued)."""
        now = (self.local_left if self.chunk is not None else self.stall_req.prompt) if self.stall_req else 0.0
        return now + sum(r.prompt for r in self.local)

    def advance(self, now: float, cap: Capacity, itl: Hist) -> None:
        """Moves the fluid to `now`, counting tokens, steps and gaps as the worker and router would."""
        dt = now - self.t_last
        if dt <= 0:
            return
        self.t_last = now
        if self.stall_end is not None:
            self.busy_s += dt
            return
        n = len(self.running)
        if self.stall_req is not None:  # chunked: one chunk and one token per stream each step
            s = cap.chunk_step_s(n, self.chunk)
            dv = dt / s
            self.local_left -= self.chunk * dv
            self.step_tokens += self.chunk * dv
            if not n:
                self.steps += dv
                self.busy_s += dt
                return
        elif not n:
            return
        else:
            s = cap.step_s(n)
            dv = dt / s
        self.v += dv
        self.gen_tokens += n * dv
        self.steps += dv
        self.step_tokens += n * dv
        self.busy_s += dt
        itl.add(s, n * dv)

    def seat(self, seq: Seq) -> None:
        seq.joined_v = self.v
        seq.v_end = self.v + seq.remaining
        heapq.heappush(self.running, (seq.v_end, next(self._ids), seq))
        self.kv_prompt += seq.req.prompt + seq.req.output - seq.remaining
        self.kv_v += self.v

    def unseat(self, seq: Seq) -> None:
        self.kv_prompt -= seq.req.prompt + seq.req.output - seq.remaining
        self.kv_v -= seq.joined_v

    def local_done(self, now: float) -> bool:
        """Whether the prompt being prefilled here has finished by `now`."""
        if self.stall_end is not None:
            return self.stall_end <= now + 1e-12
        return self.stall_req is not None and self.local_left <= 1e-6

    def next_event(self, cap: Capacity) -> float | None:
        if self.stall_end is not None:
            return self.stall_end
        n = len(self.running)
        if self.stall_req is not None:
            s = cap.chunk_step_s(n, self.chunk)
            local = self.t_last + max(0.0, self.local_left) / self.chunk * s
            return min(local, self.t_last + max(0.0, self.running[0][0] - self.v) * s) if n else local
        if not n:
            return None
        return self.t_last + max(0.0, self.running[0][0] - self.v) * cap.step_s(n)

    def reading(self) -> WorkerReading:
        n = len(self.running)
        tokens = self.kv_prompt + n * self.v - self.kv_v
        return WorkerReading(running=float(n + (self.stall_req is not None)),
                             waiting=float(len(self.waiting) + len(self.local)), leased=0.0,
                             kv_blocks_used=min(float(self.kv_blocks_total), tokens / KV_BLOCK),
                             kv_blocks_total=float(self.kv_blocks_total), prompt_tokens=self.prompt_tokens,
                             generation_tokens=self.gen_tokens, busy_seconds=self.busy_s, steps=self.steps,
                             step_tokens=self.step_tokens)
