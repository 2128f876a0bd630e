"""serve/_handoff.py: the engine's events reach the event loop in order, all of them, waking it only when the
reader can use them (each token while streaming, else only the request's end)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from shardtool.runtime import ErrorEvent, FinishEvent, TokenEvent
from shardtool.serve._handoff import BURST, Mailbox

TOKENS = [TokenEvent(t) for t in (7, 3, 9, 3, 11)]
ENDS = {"finish": FinishEvent("length"), "cancelled": FinishEvent("cancelled"),
        "error": ErrorEvent(500, "a shard failed its check", RuntimeError("x"))}


async def _read_all(box: Mailbox, n: int) -> list:
    return [await asyncio.wait_for(box.get(), 10) for _ in range(n)]


def _from_engine_thread(box: Mailbox, events: list) -> None:
    thread = threading.Thread(target=lambda: [box.put(e) for e in events], name="engine")
    thread.start()
    thread.join()


@pytest.mark.parametrize("end", sorted(ENDS))
@pytest.mark.parametrize("every_token", [False, True])
def test_every_event_arrives_in_order(end, every_token):
    events = [*TOKENS, ENDS[end]]

    async def main():
        box = Mailbox(asyncio.get_running_loop(), every_token=every_token)
        reader = asyncio.ensure_future(_read_all(box, len(events)))
        await asyncio.to_thread(_from_engine_thread, box, events)
        return box, await reader

    box, got = asyncio.run(main())
    assert got == events
    assert 1 <= box.wakeups <= (len(events) if every_token else 1)


@pytest.mark.parametrize("end", sorted(ENDS))
def test_a_json_answer_wakes_the_loop_once_at_its_end(end):
    async def main():
        box = Mailbox(asyncio.get_running_loop(), every_token=False)
        reader = asyncio.ensure_future(_read_all(box, len(TOKENS) + 1))
        await asyncio.sleep(0.01)  # the reader waits
        await asyncio.to_thread(_from_engine_thread, box, TOKENS)
        await asyncio.sleep(0.05)
        assert not reader.done() and box.wakeups == 0  # tokens alone never woke it
        await asyncio.to_thread(_from_engine_thread, box, [ENDS[end]])
        return box, await reader

    box, got = asyncio.run(main())
    assert got == [*TOKENS, ENDS[end]] and box.wakeups == 1


def test_a_stream_reads_each_token_as_it_comes():
    async def main():
        box = Mailbox(asyncio.get_running_loop(), every_token=True)
        for event in TOKENS:
            await asyncio.to_thread(box.put, event)
            assert await asyncio.wait_for(box.get(), 10) == event  # no end needed
        return box

    assert asyncio.run(main()).wakeups == len(TOKENS)


def test_events_while_a_wakeup_is_pending_ride_along():
    async def main():
        box = Mailbox(asyncio.get_running_loop(), every_token=True)
        _from_engine_thread(box, TOKENS)  # the loop is busy (this coroutine): no wake-up has run yet
        return box, await _read_all(box, len(TOKENS))

    box, got = asyncio.run(main())
    assert got == TOKENS and box.wakeups == 1


def test_a_long_answer_read_in_one_go_lets_other_tasks_run():
    events = [TokenEvent(t % 500) for t in range(10 * BURST)] + [ENDS["finish"]]

    async def main():
        box = Mailbox(asyncio.get_running_loop(), every_token=False)
        _from_engine_thread(box, events)  # all queued before the reader starts, as at a JSON answer's end
        ticks = 0

        async def other_request():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        other = asyncio.ensure_future(other_request())
        await asyncio.sleep(0)
        seen = []
        for _ in events:
            seen.append(await box.get())
            seen.append(ticks)
        other.cancel()
        return seen

    seen = asyncio.run(main())
    assert seen[0::2] == events
    ticks = seen[1::2]
    assert ticks[-1] - ticks[0] >= len(events) // BURST - 1  # the other task ran at least once per burst
    assert ticks[BURST - 2] == ticks[0]  # and a burst is read without yielding


def test_a_closed_loop_is_not_an_error_for_the_engine():
    loop = asyncio.new_event_loop()
    box = Mailbox(loop, every_token=True)
    loop.close()
    box.put(TOKENS[0])  # the server is gone: nobody listens, the engine's thread goes on
    box.put(ENDS["finish"])
