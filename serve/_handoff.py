"""One request's engine events, from the engine's thread to the event loop, with as few wake-ups as the answer needs.

Waking the loop costs a write to its self-pipe on the engine's thread and, on the loop's side, an epoll return, a
callback and the GIL taken from the engine between two of its native calls: per token, that is what the serving path
adds to a decode step. So the loop is woken only when the reader can use what arrived: at every event while the
answer streams (or must watch for a stop string), otherwise only at the request's end (its finish or error event),
when the tokens before it are read in one go (letting the loop's other tasks run every BURST events). At most one
wake-up is in flight: events that arrive while one is pending ride along with it.
"""

from __future__ import annotations

import asyncio
from collections import deque

from shardtool.runtime import Event, PromptScoresEvent, TokenEvent

# Events a reader takes in a row without waiting before it lets the loop's other tasks run: a long JSON answer is
# read in one go at its end (each token detokenized), which must not hold up the other requests' streams meanwhile.
BURST = 64


class Mailbox:
    """`put` is the engine's sink (its thread; never blocks, never raises); `get` the loop's reader. `every_token`:
    wake the reader at each token (streaming, stop strings); else only at the request's end."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, every_token: bool):
        self._loop = loop
        self._every_token = every_token
        self._events: deque[Event] = deque()  # appended on the engine's thread, popped on the loop's
        self._ready = asyncio.Event()  # the loop's side only
        self._pending = False  # a wake-up is scheduled and has not run yet
        self._burst = 0  # events taken since the reader last waited or yielded
        self.wakeups = 0  # wake-ups scheduled (for the tests: a JSON answer's tokens cost none)

    def put(self, event: Event) -> None:
        self._events.append(event)
        # The append comes first: a wake-up still pending runs after it, so its reader sees this event.
        if self._pending or (not self._every_token and isinstance(event, (TokenEvent, PromptScoresEvent))):
            return
        self._pending = True
        self.wakeups += 1
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the event loop is closed: the server is gone, nobody is listening
            pass

    def _wake(self) -> None:
        self._pending = False
        self._ready.set()

    async def get(self) -> Event:
        """The next event, in the order the engine delivered them."""
        if not self._events:
            self._burst = 0
            while not self._events:
                self._ready.clear()
                await self._ready.wait()
        else:
            self._burst += 1
            if self._burst >= BURST:
                self._burst = 0
                await asyncio.sleep(0)
        return self._events.popleft()
