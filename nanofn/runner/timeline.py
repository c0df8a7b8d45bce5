"""How busy the device is over a run: a pair of CUDA events around each launched plan's work.

The plans run one after another on the device's stream, so their event intervals do not
overlap; what lies between one plan's end and the next one's start is time the device waited
for the host. Two event records per step cost a few microseconds, unlike the profiler, which
would slow the host it is meant to watch. Each interval carries a label (the kind of step), so
that the idle time can be told apart by kind.

An eager step's interval opens after the host has laid out its inputs: a step launched onto an
idle device (a prefill of thousands of tokens, say) leaves it waiting meanwhile, and that wait is
idle time, not the step's. A graph step's interval opens as its launch begins: its inputs are
staged on the host while the device still runs the step before it.

On a CPU the events are the host clock's (``HostEvent``). With tensor parallelism, rank 0's
process keeps the timeline of its device (``tensor_parallel.RankZeroTimeline``): the ranks run
every plan in step, each on its own device.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class HostEvent:
    """A CPU's event: the host clock when it is recorded (a CPU runs a step's work before its
    launch returns), with ``torch.cuda.Event``'s ``elapsed_time`` and ``synchronize``."""

    def __init__(self) -> None:
        self.time = time.perf_counter()

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds to ``end``."""
        return (end.time - self.time) * 1e3

    def synchronize(self) -> None:
        pass


class DeviceTimeline:
    def __init__(self, device: torch.device | str = "cuda") -> None:
        self._cuda = torch.device(device).type == "cuda"
        self._intervals: list[tuple[torch.cuda.Event, torch.cuda.Event, str]] = []
        self._run: list[torch.cuda.Event] = []  # the run's start and end, when given

    def begin(self) -> None:
        """Mark the start of the run (before its first step): the idle time before the first
        step counts from here."""
        self._run = [self.mark()]

    def end(self) -> None:
        """Mark the end of the run (after its last step's results were taken)."""
        self._run.append(self.mark())

    def mark(self) -> torch.cuda.Event | HostEvent:
        if not self._cuda:
            return HostEvent()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, start: torch.cuda.Event, label: str = "") -> None:
        """Close the interval that ``start`` (from ``mark``) opened, at the work queued since."""
        self._intervals.append((start, self.mark(), label))

    @property
    def num_intervals(self) -> int:
        return len(self._intervals)

    def busy_seconds(self) -> float:
        """The device time the recorded plans took (waits for them to finish)."""
        if not self._intervals:
            return 0.0
        self._intervals[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end, _ in self._intervals) / 1e3

    def by_label(self) -> dict[str, tuple[int, float, float]]:
        """Per label: the steps, their device time, and the device's idle time just before
        them (since the previous step ended), in seconds; with ``begin`` and ``end``, also the
        idle time before the first step and after the last one."""
        if not self._intervals:
            return {}
        self._intervals[-1][1].synchronize()
        totals: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0])
        if len(self._run) == 2:
            self._run[1].synchronize()
            totals["(before the first step)"][2] = \
                self._run[0].elapsed_time(self._intervals[0][0]) / 1e3
            totals["(after the last step)"][2] = \
                self._intervals[-1][1].elapsed_time(self._run[1]) / 1e3
        previous_end = None
        for start, end, label in self._intervals:
            entry = totals[label]
            entry[0] += 1
            entry[1] += start.elapsed_time(end) / 1e3
            if previous_end is not None:
                entry[2] += max(0.0, previous_end.elapsed_time(start) / 1e3)
            previous_end = end
        return {label: tuple(values) for label, values in totals.items()}
