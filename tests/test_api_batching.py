"""Dynamic batching: single texts queued while every engine worker is busy leave as one call."""

from __future__ import annotations

import asyncio
import threading

import pytest

from service.api.batching import EngineRunner, Overloaded
from service.api.http_protocol import ON_CLIENT_GONE


def _recording_fn(calls: list[list[str]], gate: threading.Event | None = None):
    def fn(texts: list[str]) -> list[str]:
        if gate is not None:
            gate.wait(10)
        calls.append(list(texts))
        return [t.upper() for t in texts]

    return fn


def test_requests_arriving_while_the_worker_is_busy_are_coalesced_in_order():
    calls: list[list[str]] = []
    gate = threading.Event()

    async def scenario() -> list[str]:
        runner = EngineRunner(1, batching=True, max_batch=32)
        # On the pool (a lone text would be computed on the loop's thread and block it).
        blocker = asyncio.create_task(runner.run(_recording_fn(calls, gate), ["first"]))
        await asyncio.sleep(0.05)  # the only worker is now inside the blocked call
        fn = _recording_fn(calls)
        waiting = [asyncio.create_task(runner.submit_one("k", "alpha", fn, f"t{i}")) for i in range(5)]
        await asyncio.sleep(0.05)
        gate.set()
        out = [*(await blocker)] + [await w for w in waiting]
        runner.shutdown()
        return out

    out = asyncio.run(scenario())
    assert out == ["FIRST", "T0", "T1", "T2", "T3", "T4"]
    assert calls == [["first"], ["t0", "t1", "t2", "t3", "t4"]]


def test_batches_are_capped_at_max_batch_and_keys_never_mix():
    calls: list[list[str]] = []
    gate = threading.Event()

    async def scenario() -> dict[str, str]:
        runner = EngineRunner(1, batching=True, max_batch=2)
        blocker = asyncio.create_task(runner.run(_recording_fn(calls, gate), ["b"]))  # on the pool
        await asyncio.sleep(0.05)
        fn = _recording_fn(calls)
        tasks = {f"{key}{i}": asyncio.create_task(runner.submit_one(key, "alpha", fn, f"{key}{i}"))
                 for key in ("p", "q") for i in range(3)}
        await asyncio.sleep(0.05)
        gate.set()
        await blocker
        out = {name: await t for name, t in tasks.items()}
        runner.shutdown()
        return out

    out = asyncio.run(scenario())
    assert out == {name: name.upper() for name in out}
    batches = calls[1:]
    assert all(len(b) <= 2 for b in batches)
    assert all(len({t[0] for t in b}) == 1 for b in batches)  # one key per engine call
    assert sorted(t for b in batches for t in b) == ["p0", "p1", "p2", "q0", "q1", "q2"]


def test_an_engine_failure_reaches_every_request_of_the_batch():
    def boom(texts: list[str]) -> list[str]:
        raise RuntimeError("engine failed")

    async def scenario() -> list[BaseException | str]:
        runner = EngineRunner(1, batching=True, max_batch=8)
        tasks = [asyncio.create_task(runner.submit_one("k", "alpha", boom, str(i))) for i in range(3)]
        out = await asyncio.gather(*tasks, return_exceptions=True)
        runner.shutdown()
        return out

    out = asyncio.run(scenario())
    assert len(out) == 3 and all(isinstance(e, RuntimeError) for e in out)


@pytest.mark.parametrize("batching", [True, False])
def test_batch_sizes_are_reported(batching):
    sizes: list[int] = []

    async def scenario() -> None:
        runner = EngineRunner(2, batching=batching, on_batch=lambda _scorer, n: sizes.append(n))
        await asyncio.gather(*(runner.submit_one("k", "alpha", lambda ts: ts, str(i)) for i in range(4)))
        runner.shutdown()

    asyncio.run(scenario())
    assert sum(sizes) == 4 and (batching or sizes == [1, 1, 1, 1])


def test_a_lone_request_is_computed_at_once_and_a_busy_runner_still_queues_it():
    calls: list[list[str]] = []
    gate = threading.Event()

    async def scenario() -> list[str]:
        runner = EngineRunner(1, batching=True, max_batch=8)
        # Idle: computed within the call, on this thread (no turn of the loop).
        first = await runner.submit_one("k", "alpha", _recording_fn(calls), "alone", alone=True)
        blocker = asyncio.create_task(runner.run(_recording_fn(calls, gate), ["busy"]))
        await asyncio.sleep(0.05)  # the only worker is now inside the blocked call (on the pool)
        # Said to be alone, but the worker is busy: it waits its turn and shares the next call.
        fn = _recording_fn(calls)
        queued = [asyncio.create_task(runner.submit_one("k", "alpha", fn, t, alone=t == "a")) for t in ("a", "b")]
        await asyncio.sleep(0.05)
        gate.set()
        out = [first, *(await blocker)] + [await q for q in queued]
        runner.shutdown()
        return out

    assert asyncio.run(scenario()) == ["ALONE", "BUSY", "A", "B"]
    assert calls == [["alone"], ["busy"], ["a", "b"]]


async def _behind_a_busy_engine(runner: EngineRunner, calls: list[list[str]], queue_up, wait_s: float = 0.05) -> list:
    """What queue_up(fn) starts (awaited: a list of tasks) while the runner's only slot computes a
    gated call; after wait_s the gate opens. The outcomes: the busy call's, then each task's."""
    gate = threading.Event()
    blocker = asyncio.create_task(runner.run(_recording_fn(calls, gate), ["busy"]))
    await asyncio.sleep(0.05)  # the only worker is now inside the blocked call
    tasks = await queue_up(_recording_fn(calls))
    await asyncio.sleep(wait_s)
    gate.set()
    out = await asyncio.gather(blocker, *tasks, return_exceptions=True)
    runner.shutdown()
    return out


def test_the_line_admits_exactly_max_queued_texts():
    calls: list[list[str]] = []

    async def queue_up(fn) -> list:
        return [asyncio.create_task(runner.run_batch("alpha", fn, ["a", "b", "c"])),  # 3 of 4
                asyncio.create_task(runner.submit_one("k", "alpha", fn, "d")),  # 4 of 4: at the bound
                asyncio.create_task(runner.submit_one("k", "alpha", fn, "e"))]  # one past it

    runner = EngineRunner(1, max_batch=8, max_queued_texts=4)
    busy, batch, single, past = asyncio.run(_behind_a_busy_engine(runner, calls, queue_up))
    assert (busy, list(batch), single) == (["BUSY"], ["A", "B", "C"], "D")
    assert isinstance(past, Overloaded) and past.reason == "queue_full"
    assert calls == [["busy"], ["a", "b", "c"], ["d"]]


@pytest.mark.parametrize(("bound_s", "refused"), [(0.1, True), (5.0, False)])
def test_the_wait_bound_counts_time_in_line_not_time_computing(bound_s, refused):
    async def queue_up(fn) -> list:
        return [asyncio.create_task(runner.run_batch("alpha", fn, ["a"])),
                asyncio.create_task(runner.submit_one("k", "alpha", fn, "b"))]

    runner = EngineRunner(1, max_queue_wait_s=bound_s)
    busy, batch, single = asyncio.run(_behind_a_busy_engine(runner, [], queue_up, wait_s=0.3))
    assert busy == ["BUSY"]  # computing 0.35 s is not waiting
    if refused:  # 0.3 s in line, past the bound
        assert all(isinstance(r, Overloaded) and r.reason == "queue_wait" for r in (batch, single))
    else:
        assert (batch, single) == (["A"], "B")


def test_a_waiting_request_whose_client_left_leaves_the_line_and_frees_its_place():
    calls: list[list[str]] = []

    async def queue_up(fn) -> list:
        states: list[dict] = [{}, {}]
        left = [asyncio.create_task(runner.run_batch("alpha", fn, ["gone-batch"], states[0])),
                asyncio.create_task(runner.submit_one("k", "alpha", fn, "gone-text", state=states[1]))]
        await asyncio.sleep(0.05)
        for state in states:  # what the HTTP protocol does when their connections are lost
            state.pop(ON_CLIENT_GONE)()
        return [*left, *(asyncio.create_task(runner.submit_one("k", "alpha", fn, t)) for t in ("x", "y"))]

    runner = EngineRunner(1, max_batch=8, max_queued_texts=2)
    out = asyncio.run(_behind_a_busy_engine(runner, calls, queue_up))
    assert [type(r).__name__ for r in out[1:3]] == ["ClientDisconnect", "ClientDisconnect"]
    assert out[3:] == ["X", "Y"]  # in the places the two left
    assert calls == [["busy"], ["x", "y"]]  # the two that left were never computed
