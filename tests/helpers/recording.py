"""A consumer that keeps a call's events, and a backend wrapped so the recorder sees them."""

from __future__ import annotations

from air_magic.protocol.events import RankExited, RankState


class Recorder:
    """A consumer that keeps every event, in the order the backend reported them."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def handle(self, event: object) -> None:
        self.events.append(event)

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def exits(self) -> dict[int, tuple[RankState, str]]:
        """Each rank's end, as the bus told it: ``{rank: (state, reason)}``."""
        return {e.rank: (e.state, e.reason) for e in self.of(RankExited)}


class Recording:
    """``inner``, with ``recorder`` added to the consumers of its events."""

    def __init__(self, inner, recorder: Recorder):
        self.inner, self.recorder, self.name = inner, recorder, inner.name

    def prepare(self, settings):
        return self.inner.prepare(settings)

    def run(self, request, bus):
        bus.add(self.recorder)
        return self.inner.run(request, bus)

    def stop(self) -> None:
        self.inner.stop()
