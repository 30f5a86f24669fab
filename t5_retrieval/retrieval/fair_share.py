"""Worker time shared fairly between address ranges: per-range queues in front of the worker threads.

A request is run as a few *steps* (parse and the first queries, then the next `QUERIES_PER_STEP`
queries each), and each step waits in its range's queue for a worker. When a worker is free, the
next step is taken from the waiting range that has used the least worker time (wall seconds its
steps ran, its running steps' so far included), the earliest to arrive among equals; within a
range, first in, first out, a request's later steps before the range's new requests. Only ranges
with work in flight are tracked, and a range that starts again begins at the least time of those
in flight, so time not used is not banked (start-time fair queueing, as Linux's CFS schedules
threads). A range thus gets its share of the workers, 1/n of them with n ranges in flight: many
clients of one range share that range's share.

The bound: a request whose range has nothing else in flight starts at the least time of the
ranges in flight, so it is next in line as soon as it arrives (after, at most, one step of the
range it ties with), and waits for one worker to finish the step it runs (at most
`QUERIES_PER_STEP` queries of `max_k` results), however many ranges flood the server with the most
expensive searches.

How many requests may wait: `workers` run and `max_queued` more wait, counted per request. When
all are taken, a newcomer whose range has at least two fewer requests in flight than the range
holding the most takes the place of that range's newest request not yet started (which gets 503),
as the connections and the body memory do (`http_server.ConnectionTable`, `http_app.BodyBudget`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

QUERIES_PER_STEP = 8  # a request's queries are searched this many at a time, each batch a step of its own


class Refused(Exception):
    """A request the queue has no room for (503): its message says why."""


@dataclasses.dataclass(eq=False)
class _Step:
    where: str
    started: asyncio.Future  # set (by `_dispatch`) when a worker is this step's
    request: _Request


@dataclasses.dataclass(eq=False)
class _Request:
    where: str
    begun: bool = False  # its first step has had a worker: it is never given up after


class FairQueue:
    """`workers` threads; steps wait in per-range queues and are run least-used range first.

    Touched only from the event loop (`run` is a coroutine), except the threads that run steps."""

    def __init__(self, workers: int, max_queued: int, clock: Callable[[], float] = time.perf_counter):
        self.workers, self.max_queued = workers, max_queued
        self.clock = clock
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="t5r-serve")
        self.running = 0
        self._started: dict[str, list[float]] = {}  # when each running step of a range started
        self.used: dict[str, float] = {}  # worker seconds of each range with requests in flight
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._arrival: dict[str, int] = {}  # tie-breaker: when the range last started being tracked
        self._queues: dict[str, collections.deque[_Step]] = {}
        self._requests: dict[str, list[_Request]] = {}
        self._order = itertools.count()

    def begin(self, where: str) -> _Request:
        """Admits a request of range `where`, or raises Refused (the queue is full, even by the fairness rule)."""
        total = sum(self._in_flight.values())
        if total >= self.workers + self.max_queued and not self._make_room(self._in_flight[where]):
            raise Refused(f"server busy ({self.workers} workers, {self.max_queued} queued); retry later")
        if not self._in_flight[where]:
            now = self.clock()
            self.used[where] = min((self._time(w, now) for w in self.used), default=0.0)  # not banked while idle
            self._arrival[where] = next(self._order)
        self._in_flight[where] += 1
        request = _Request(where)
        self._requests.setdefault(where, []).append(request)
        return request

    def end(self, request: _Request) -> None:
        """The request is answered (or refused): its range is no longer tracked once it has none in flight."""
        where = request.where
        self._requests[where].remove(request)
        self._in_flight[where] -= 1
        if not self._in_flight[where]:
            del self._in_flight[where], self.used[where], self._arrival[where], self._requests[where]

    async def run(self, request: _Request, function: Callable[..., T], *args: Any) -> T:
        """Runs one step of `request` on a worker when its turn comes; raises Refused if the request
        is given up for another range's before its first step starts."""
        step = _Step(request.where, asyncio.get_running_loop().create_future(), request)
        queue = self._queues.setdefault(step.where, collections.deque())
        if request.begun:
            queue.appendleft(step)  # a request under way goes before its range's new ones
        else:
            queue.append(step)
        self._dispatch()
        try:
            await step.started
        except BaseException:
            started = step.started
            if started.done() and not started.cancelled() and started.exception() is None:
                self._finished(step.where, 0.0)  # it had a worker, and was cancelled before it ran
            else:
                self._forget(step)
            raise
        request.begun = True
        timed = _Timed(function, args, self.clock)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, timed)
        finally:
            self._finished(step.where, timed.elapsed)

    def _finished(self, where: str, elapsed: float) -> None:
        """A step of `where` has ended after `elapsed` seconds: charged, and its worker given to the next."""
        self.running -= 1
        started = self._started[where]
        started.remove(min(started))  # the oldest start stands for it: the sum over running steps is the same
        if not started:
            del self._started[where]
        if where in self.used:
            self.used[where] += elapsed
        self._dispatch()

    def _dispatch(self) -> None:
        while self.running < self.workers and self._queues:
            now = self.clock()
            where = min(self._queues, key=lambda w: (self._time(w, now), self._arrival.get(w, 0)))
            queue = self._queues[where]
            step = queue.popleft()
            if not queue:
                del self._queues[where]
            self.running += 1
            self._started.setdefault(where, []).append(now)
            step.started.set_result(None)

    def _time(self, where: str, now: float) -> float:
        """The worker time `where` has used: its finished steps', and its running steps' so far."""
        return self.used.get(where, 0.0) + sum(now - start for start in self._started.get(where, ()))

    def _forget(self, step: _Step) -> None:
        queue = self._queues.get(step.where)
        if queue is not None and step in queue:
            queue.remove(step)
            if not queue:
                del self._queues[step.where]

    def _make_room(self, held: int) -> bool:
        """Gives up the newest request not yet started of the range with the most in flight, if it
        holds at least `held` + 2."""
        for where, count in self._in_flight.most_common():
            if count < held + 2:
                return False
            queue = self._queues.get(where, ())
            victim = next((s for s in reversed(queue) if not s.request.begun), None)
            if victim is not None:
                self._forget(victim)
                victim.started.set_exception(Refused(
                    "server busy, and your address range has the most requests waiting; retry later"))
                return True
        return False

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class _Timed:
    """`function(*args)`, and how long it ran (wall seconds, on its worker thread)."""

    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...], clock: Callable[[], float]):
        self.function, self.args, self.clock = function, args, clock
        self.elapsed = 0.0

    def __call__(self) -> Any:
        start = self.clock()
        try:
            return self.function(*self.args)
        finally:
            self.elapsed = self.clock() - start
