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
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
BatchFn = Callable[[list[str]], Sequence[Any]]


@dataclass
class _Queue:
    key: Hashable
    kind: str
    fn: BatchFn
    texts: list[str] = field(default_factory=list)
    futures: list[asyncio.Future] = field(default_factory=list)
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
    ) -> None:
        self.workers = workers
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

    # -- whole requests ----------------------------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on an engine worker, waiting for a free slot."""
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

        self._when_free(lambda: self._on_pool(loop, fn, args, done))
        return await out

    async def run_batch(self, kind: str, fn: BatchFn, texts: list[str]) -> Sequence[Any]:
        if self.on_batch is not None:
            self.on_batch(kind, len(texts))
        return await self.run(fn, texts)

    # -- single texts, batched ----------------------------------------------------------------

    async def submit_one(self, key: Hashable, kind: str, fn: BatchFn, text: str, alone: bool = False) -> Any:
        """fn([text])[0], possibly computed in one call together with other texts of the same key.

        alone: no other request is in progress on this server (none could join a batch), so
        with nothing queued or computing the text is computed here and now, without waiting a
        turn of the loop for company: at one connection that turn (a future, a callback, the
        request's task suspended and resumed) was a tenth of predict's time beyond echo's and
        the engine's (bench/RESULTS.md, issue 22)."""
        if not self.batching:
            return (await self.run_batch(kind, fn, [text]))[0]
        if alone and self._free == self.workers and not self._queues and not self._waiting:
            self._free -= 1
            try:
                return self._batch(kind, fn, [text])[0]
            finally:
                self._free += 1
        loop = asyncio.get_running_loop()
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
        if queue.timer is not None and len(queue.texts) >= self.max_batch:
            queue.timer.cancel()
            queue.timer = None
            loop.call_soon(self._leave, loop, queue)
        return await fut

    def _leave(self, loop: asyncio.AbstractEventLoop, queue: _Queue) -> None:
        """The queue stops waiting for company and lines up for a slot."""
        queue.timer = None
        self._when_free(lambda: self._start(loop, queue))

    def _start(self, loop: asyncio.AbstractEventLoop, queue: _Queue) -> None:
        """In a slot: close the queue to newcomers (from here on they start the next batch) and
        compute its first max_batch texts; the rest go back as a queue at the front of the line."""
        if self._queues.get(queue.key) is queue:
            del self._queues[queue.key]
        texts, futures = queue.texts, queue.futures
        if len(texts) > self.max_batch:
            rest_texts, rest_futures = texts[self.max_batch:], futures[self.max_batch:]
            texts, futures = texts[: self.max_batch], futures[: self.max_batch]
            nxt = self._queues.get(queue.key)
            if nxt is not None:
                nxt.texts[:0], nxt.futures[:0] = rest_texts, rest_futures
            else:
                rest = self._queues[queue.key] = _Queue(queue.key, queue.kind, queue.fn, rest_texts, rest_futures)
                self._waiting.appendleft(lambda: self._start(loop, rest))
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
