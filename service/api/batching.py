"""Engine calls off the event loop, with dynamic batching of concurrent single texts.

A bounded pool runs engine work, `workers` calls at a time; work that finds every slot taken
waits in line (in arrival order) instead of queueing inside the pool. Single-text requests with
the same (engine, scorer, k, alpha, beam) wait in a shared queue, so while every worker is busy
they pile up and leave as one batch; a lone request on an idle server leaves at once (unless
max_wait_s > 0 asks it to wait for company).

A queue leaves from a callback scheduled when its first text arrives: it runs after the
loop's handlers already ready, so every request that had arrived by then joins the batch. A
batch of one text when no other engine call is running is computed on the event loop's own
thread: handing it to a pool thread and back (two thread wake-ups, the GIL passed twice) cost
more than the engine's ~0.15 ms call itself (debian-deps at one connection: predict p50 677 ->
522 us), and at that moment the loop has nothing else to do that the call delays.

Plain callbacks and futures, no task per batch and no asyncio.Semaphore: this is on every
request's path, and a task, a semaphore and their wake-ups cost a lone request more than the
rest of the hand-off (bench/RESULTS.md, issue 22).

The line is bounded (admission control): a request that would have to wait while
`max_queued_texts` texts already wait is refused at once, and one that waited longer than
`max_queue_wait_s` before its engine call starts is refused then (Overloaded: a 503 with
Retry-After), so a flood gets quick refusals a load balancer can act on instead of answers
that come tens of seconds late. A request whose client leaves while it waits leaves the line
(starlette's ClientDisconnect, counted 499): the HTTP protocol calls the request's
ON_CLIENT_GONE (service.api.http_protocol), so nothing polls. Only requests that wait pay for
any of this; a request that finds a free slot never checks.
"""

from __future__ import annotations

import asyncio
import bisect
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect

from service.api.http_protocol import CLIENT_GONE, ON_CLIENT_GONE

T = TypeVar("T")
BatchFn = Callable[[list[str]], Sequence[Any]]


class Overloaded(Exception):
    """The line in front of the engine is full, or a request waited in it too long: `reason`
    "queue_full" or "queue_wait", `message` says which limit (a 503 for the client)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


@dataclass
class _Queue:
    key: Hashable
    kind: str
    fn: BatchFn
    texts: list[str] = field(default_factory=list)
    futures: list[asyncio.Future] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)  # loop.time() each text joined, in order
    timer: asyncio.TimerHandle | None = None  # the max_wait_s wait, while it lasts


class EngineRunner:
    def __init__(
        self,
        workers: int,
        *,
        batching: bool = True,
        max_batch: int = 32,
        max_wait_s: float = 0.0,
        on_batch: Callable[[str, int], None] | None = None,
        max_queued_texts: int = 1 << 30,
        max_queue_wait_s: float = float("inf"),
    ) -> None:
        self.workers = workers
        self.max_queued_texts = max_queued_texts
        self.max_queue_wait_s = max_queue_wait_s
        self._queued_texts = 0  # texts waiting in line (in _waiting and in the open queues)
        self.batching = batching
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.on_batch = on_batch
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="engine")
        self._free = workers  # slots: engine calls that may start now
        self._waiting: deque[Callable[[], None]] = deque()  # what starts when a slot frees, in order
        self._queues: dict[Hashable, _Queue] = {}  # open queues of single texts, by key
        self._running = 0  # engine calls on the pool now

    # -- slots ----------------------------------------------------------------------------

    def _when_free(self, start: Callable[[], None]) -> None:
        """start() in a slot now, or once one frees (after those already waiting)."""
        if self._free and not self._waiting:
            self._free -= 1
            start()
        else:
            self._waiting.append(start)

    def _release(self) -> None:
        """A slot frees: it passes to the first in line (on the loop's next turn, so that a line
        of lone texts computed here one after another never nests), or stays free."""
        if self._waiting:
            asyncio.get_running_loop().call_soon(self._waiting.popleft())
        else:
            self._free += 1

    def _on_pool(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], args: tuple,
                 done: Callable[[Future], None]) -> None:
        """In a slot: fn(*args) on a pool thread, then on the loop done(its future) and the slot freed."""
        self._running += 1

        def finished(cf: Future) -> None:
            self._running -= 1
            try:
                done(cf)
            finally:
                self._release()

        try:
            cf = self._pool.submit(fn, *args)
        except BaseException as exc:  # a pool shut down: the failure goes where a result would
            cf = Future()
            cf.set_exception(exc)
            finished(cf)
            return
        cf.add_done_callback(lambda cf: loop.call_soon_threadsafe(finished, cf))

    # -- the line ------------------------------------------------------------------------------

    def _admit(self, texts: int, state: dict[str, Any] | None) -> None:
        """`texts` more texts join the line, or why not: the client has gone, or the line is full."""
        if state is not None and state.get(CLIENT_GONE):
            raise ClientDisconnect()
        if self._queued_texts + texts > self.max_queued_texts:
            raise Overloaded("queue_full", f"the engine is busy: {self._queued_texts} texts wait for it "
                             f"(at most {self.max_queued_texts})")
        self._queued_texts += texts

    def _too_late(self, waited_s: float) -> Overloaded:
        return Overloaded("queue_wait", f"the engine is busy: the request waited {waited_s * 1000:.0f} ms for it "
                          f"(at most {self.max_queue_wait_s * 1000:.0f} ms)")

    def _line_up(self, loop: asyncio.AbstractEventLoop, out: asyncio.Future, texts: int,
                 state: dict[str, Any] | None, start: Callable[[], None]) -> None:
        """start() once a slot is ours, unless by then the request waited too long or its client left."""
        self._admit(texts, state)
        arrived = loop.time()

        def turn() -> None:
            self._queued_texts -= texts
            if out.done():  # its client left between the slot's hand-over and now
                self._release()
            elif loop.time() - arrived > self.max_queue_wait_s:
                out.set_exception(self._too_late(loop.time() - arrived))
                self._release()
            else:
                start()

        def client_gone() -> None:
            try:
                self._waiting.remove(turn)
            except ValueError:
                pass  # its turn came already (turn() counts it)
            else:
                self._queued_texts -= texts
            if not out.done():
                out.set_exception(ClientDisconnect())

        self._waiting.append(turn)
        if state is not None:
            state[ON_CLIENT_GONE] = client_gone

    # -- whole requests ----------------------------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any, texts: int = 1,
                  state: dict[str, Any] | None = None) -> T:
        """fn(*args) on an engine worker, waiting for a free slot. `texts`: what the call counts
        in the line; `state`: the request's scope state, through which the HTTP protocol says
        its client left (module docstring)."""
        loop = asyncio.get_running_loop()
        out: asyncio.Future = loop.create_future()

        def done(cf: Future) -> None:
            if out.done():
                return
            exc = cf.exception()
            if exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(cf.result())

        if self._free and not self._waiting:
            self._free -= 1
            self._on_pool(loop, fn, args, done)
        else:
            self._line_up(loop, out, texts, state, lambda: self._on_pool(loop, fn, args, done))
        return await out

    async def run_batch(self, kind: str, fn: BatchFn, texts: list[str],
                        state: dict[str, Any] | None = None) -> Sequence[Any]:
        return await self.run(self._batch, kind, fn, texts, texts=len(texts), state=state)

    # -- single texts, batched ----------------------------------------------------------------

    async def submit_one(self, key: Hashable, kind: str, fn: BatchFn, text: str, alone: bool = False,
                         state: dict[str, Any] | None = None) -> Any:
        """fn([text])[0], possibly computed in one call together with other texts of the same key.

        alone: no other request is in progress on this server (none could join a batch), so
        with nothing queued or computing the text is computed here and now, without waiting a
        turn of the loop for company: at one connection that turn (a future, a callback, the
        request's task suspended and resumed) was a tenth of predict's time beyond echo's and
        the engine's (bench/RESULTS.md, issue 22). Not with max_wait_s > 0: the operator asked
        a lone request to wait for company."""
        if not self.batching:
            return (await self.run_batch(kind, fn, [text], state))[0]
        if alone and not self.max_wait_s and self._free == self.workers and not self._queues and not self._waiting:
            self._free -= 1
            try:
                return self._batch(kind, fn, [text])[0]
            finally:
                self._free += 1
        loop = asyncio.get_running_loop()
        self._admit(1, state)
        fut = loop.create_future()
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _Queue(key, kind, fn)
            if self.max_wait_s > 0:
                queue.timer = loop.call_later(self.max_wait_s, self._leave, loop, queue)
            else:
                loop.call_soon(self._leave, loop, queue)
        queue.texts.append(text)
        queue.futures.append(fut)
        queue.arrived.append(loop.time())
        if state is not None:
            state[ON_CLIENT_GONE] = lambda: self._drop_text(fut)
        if queue.timer is not None and len(queue.texts) >= self.max_batch:
            queue.timer.cancel()
            queue.timer = None
            loop.call_soon(self._leave, loop, queue)
        return await fut

    def _drop_text(self, fut: asyncio.Future) -> None:
        """A queued text whose client left leaves its queue (every text waiting for its turn is in
        an open queue: one closes when its turn comes)."""
        for queue in self._queues.values():
            try:
                i = queue.futures.index(fut)
            except ValueError:
                continue
            del queue.texts[i], queue.futures[i], queue.arrived[i]
            self._queued_texts -= 1
            break
        if not fut.done():
            fut.set_exception(ClientDisconnect())

    def _drop_expired(self, loop: asyncio.AbstractEventLoop, queue: _Queue) -> None:
        """Texts that waited past max_queue_wait_s are refused (they joined in order: a prefix)."""
        now = loop.time()
        n = bisect.bisect_left(queue.arrived, now - self.max_queue_wait_s)
        if n:
            error = self._too_late(now - queue.arrived[0])
            for f in queue.futures[:n]:
                if not f.done():
                    f.set_exception(error)
            del queue.texts[:n], queue.futures[:n], queue.arrived[:n]
            self._queued_texts -= n

    def _leave(self, loop: asyncio.AbstractEventLoop, queue: _Queue) -> None:
        """The queue stops waiting for company and lines up for a slot."""
        queue.timer = None
        self._when_free(lambda: self._start(loop, queue))

    def _start(self, loop: asyncio.AbstractEventLoop, queue: _Queue) -> None:
        """In a slot: close the queue to newcomers (from here on they start the next batch) and
        compute its first max_batch texts; the rest go back as a queue at the front of the line."""
        if self._queues.get(queue.key) is queue:
            del self._queues[queue.key]
        self._drop_expired(loop, queue)
        texts, futures, m = queue.texts, queue.futures, self.max_batch
        if len(texts) > m:
            rest = (texts[m:], futures[m:], queue.arrived[m:])
            texts, futures = texts[:m], futures[:m]
            nxt = self._queues.get(queue.key)
            if nxt is not None:
                nxt.texts[:0], nxt.futures[:0], nxt.arrived[:0] = rest
            else:
                left = self._queues[queue.key] = _Queue(queue.key, queue.kind, queue.fn, *rest)
                self._waiting.appendleft(lambda: self._start(loop, left))
        self._queued_texts -= len(texts)
        if not texts:  # every client left, or waited too long
            self._release()
            return
        call = (queue.kind, queue.fn, texts)
        if len(texts) == 1 and self._running == 0:
            try:
                _settle(futures, self._batch, call)  # alone: on this thread (module docstring)
            finally:
                self._release()
        else:
            self._on_pool(loop, self._batch, call, lambda cf: _settle(futures, cf.result, ()))

    def _batch(self, kind: str, fn: BatchFn, texts: list[str]) -> Sequence[Any]:
        if self.on_batch is not None:
            self.on_batch(kind, len(texts))
        return fn(texts)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _settle(futures: list[asyncio.Future], compute: Callable[..., Sequence[Any]], args: Any) -> None:
    """Each future gets its share of compute(*args), or every one its failure (none hangs)."""
    try:
        results = compute(*args)
    except BaseException as exc:
        for f in futures:
            if not f.done():
                f.set_exception(exc)
        if not isinstance(exc, Exception):
            raise
    else:
        for f, r in zip(futures, results, strict=True):
            if not f.done():
                f.set_result(r)
