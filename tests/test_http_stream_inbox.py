"""The streamed endpoint's hand-over from the engine's thread (megarl/rollout/http_stream.py ``TokenInbox``):
steps pushed while the handler has not taken the last ones join one delivery behind one wake-up, and
what the handler takes adds up to what the engine recorded."""
import asyncio

from megarl.rollout.http_stream import TokenInbox


class _Loop:
    """call_soon_threadsafe recorded, run when the test says (the handler's loop, not yet turning)."""

    def __init__(self):
        self.calls = []

    def call_soon_threadsafe(self, fn, *args):
        self.calls.append((fn, args))

    def run(self):
        calls, self.calls = self.calls, []
        for fn, args in calls:
            fn(*args)


def test_steps_not_yet_taken_join_one_delivery():
    loop, events = _Loop(), asyncio.Queue()
    inbox = TokenInbox(2, loop, events)
    push0, push1 = inbox.pusher(0), inbox.pusher(1)
    ids, lps = [], []  # the engine's lists of choice 0, grown step by step and handed over whole
    for step in range(3):
        ids.append(10 + step)
        lps.append(-0.1 * step)
        push0(ids, lps)
    push1([7], [-1.0])
    push0(ids, lps)  # nothing new: no wake-up
    loop.run()
    assert [events.get_nowait() for _ in range(events.qsize())] == [(0, False), (1, False)]
    assert inbox.take(0) == ([10, 11, 12], [0.0, -0.1, -0.2]) and inbox.take(1) == ([7], [-1.0])
    ids.append(13)
    lps.append(-0.3)
    push0(ids, lps)  # after a take: a new wake-up with only the new token
    loop.run()
    assert events.get_nowait() == (0, False) and inbox.take(0) == ([13], [-0.3])
    assert inbox.take(0) == ([], []) and events.empty()
