"""Engine calls off the event loop, with dynamic batching of concurrent single texts.

A bounded pool runs engine work; a slot semaphore of the same size keeps jobs from
queueing inside the pool. Single-text requests with the same (engine, scorer, k, alpha,
beam) wait for a free slot in a shared queue, so while every worker is busy they pile up
and leave as one batch; a lone request on an idle server leaves at once (unless
max_wait_s > 0 asks it to wait for company).

A batch of one text when no other engine call is running is computed on the event loop's
own thread: handing it to a pool thread and back (two thread wake-ups, the GIL passed twice)
cost more than the engine's ~0.15 ms call itself (debian-deps at one connection: predict p50
677 -> 522 us), and at that moment the loop has nothing else to do that the call delays
(every request that had arrived joined the batch first: the dispatcher runs after the loop's
ready handlers).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
BatchFn = Callable[[list[str]], Sequence[Any]]


@dataclass
class _Queue:
    fn: BatchFn
    texts: list[str] = field(default_factory=list)
    futures: list[asyncio.Future] = field(default_factory=list)
    full: asyncio.Event = field(default_factory=asyncio.Event)


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
        self._slots: asyncio.Semaphore | None = None
        self._queues: dict[Hashable, _Queue] = {}
        self._running = 0  # engine calls on the pool now
        # The event loop holds tasks weakly; keep dispatchers alive until they finish.
        self._tasks: set[asyncio.Task] = set()

    def _spawn(self, key: Hashable, kind: str, queue: _Queue) -> None:
        task = asyncio.get_running_loop().create_task(self._dispatch(key, kind, queue))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _sem(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        return self._slots

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on an engine worker, waiting for a free slot."""
        async with self._sem():
            return await self._on_pool(fn, *args)

    async def _on_pool(self, fn: Callable[..., T], *args: Any) -> T:
        self._running += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._running -= 1

    async def run_batch(self, kind: str, fn: BatchFn, texts: list[str]) -> Sequence[Any]:
        if self.on_batch is not None:
            self.on_batch(kind, len(texts))
        return await self.run(fn, texts)

    async def submit_one(self, key: Hashable, kind: str, fn: BatchFn, text: str) -> Any:
        """fn([text])[0], possibly computed in one call together with other texts of the same key."""
        if not self.batching:
            return (await self.run_batch(kind, fn, [text]))[0]
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _Queue(fn)
            self._spawn(key, kind, queue)
        queue.texts.append(text)
        queue.futures.append(fut)
        if len(queue.texts) >= self.max_batch:
            queue.full.set()
        return await fut

    async def _dispatch(self, key: Hashable, kind: str, queue: _Queue) -> None:
        if self.max_wait_s > 0:
            try:
                await asyncio.wait_for(queue.full.wait(), self.max_wait_s)
            except TimeoutError:
                pass
        await self._sem().acquire()
        # Close this queue to newcomers: from here on they start the next batch.
        if self._queues.get(key) is queue:
            del self._queues[key]
        texts, futures = queue.texts, queue.futures
        # Anything beyond max_batch goes back as a new queue at the front of the line.
        if len(texts) > self.max_batch:
            rest = _Queue(queue.fn, texts[self.max_batch:], futures[self.max_batch:])
            texts, futures = texts[: self.max_batch], futures[: self.max_batch]
            if key in self._queues:
                nxt = self._queues[key]
                nxt.texts[:0], nxt.futures[:0] = rest.texts, rest.futures
            else:
                self._queues[key] = rest
                self._spawn(key, kind, rest)
        try:
            if self.on_batch is not None:
                self.on_batch(kind, len(texts))
            if len(texts) == 1 and self._running == 0:
                results = queue.fn(texts)  # alone: on this thread (module docstring)
            else:
                results = await self._on_pool(queue.fn, texts)
        except BaseException as exc:  # every waiter gets the failure, none hangs
            for f in futures:
                if not f.done():
                    f.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            for f, r in zip(futures, results, strict=True):
                if not f.done():
                    f.set_result(r)
        finally:
            self._sem().release()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
