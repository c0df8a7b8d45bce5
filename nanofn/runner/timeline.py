"""How busy the device is over a run: a pair of CUDA events around each launched plan's work.

The plans run one after another on the device's stream, so their event intervals do not
overlap; what lies between one plan's end and the next one's start is time the device waited
for the host. Two event records per step cost a few microseconds, unlike the profiler, which
would slow the host it is meant to watch.
"""

from __future__ import annotations

import torch


class DeviceTimeline:
    def __init__(self) -> None:
        self._intervals: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @staticmethod
    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, start: torch.cuda.Event) -> None:
        """Close the interval that ``start`` (from ``mark``) opened, at the work queued since."""
        self._intervals.append((start, self.mark()))

    @property
    def num_intervals(self) -> int:
        return len(self._intervals)

    def busy_seconds(self) -> float:
        """The device time the recorded plans took (waits for them to finish)."""
        if not self._intervals:
            return 0.0
        self._intervals[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in self._intervals) / 1e3
