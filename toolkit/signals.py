"""Stopping a run on request: SIGINT or SIGTERM (Ctrl-C, a launcher's or a scheduler's stop) asks
the loop to finish its step, save and exit 0, in every rank.

    with StopRequest() as stop_request:
        while training:
            ...
            if stop_request.requested: save and break
"""
import signal
import time

SIGNAL_GRACE_S = 5.0  # more SIGINT/SIGTERM within this time of the first are the same request


class StopRequest:
    """SIGINT/SIGTERM ask the loop to finish its step, save and exit 0 (in every rank). Repeats
    within a few seconds are the same request (Ctrl-C signals every process, and a launcher forwards
    SIGTERM too); a later one stops at once. The handlers are restored when the block ends."""

    def __enter__(self) -> "StopRequest":
        self.requested, self.first = False, 0.0
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.requested and now - self.first > SIGNAL_GRACE_S:
            raise KeyboardInterrupt
        if not self.requested:
            self.requested, self.first = True, now
