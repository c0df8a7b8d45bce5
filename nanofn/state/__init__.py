"""The pure engine core: records, the running batch's columns, block pool, prefix cache,
scheduler, stopping policy, step and traces.

Nothing here imports torch, touches files, reads clocks or draws random numbers: every function
maps immutable values to new immutable values. One object is shared between states, the
append-only ``SeqStore`` behind the running batch, and it is written only where no state can
see (``nanofn.state.store`` says how), so no state ever changes.
"""

from nanofn.state.config import SchedulerConfig, blocks_for
from nanofn.state.engine_state import Counters, EngineState, initial_state
from nanofn.state.figures import Figures, figures
from nanofn.state.params import SamplingParams
from nanofn.state.plan import (PENDING_TOKEN, BatchPlan, SampleOutput, ScheduledSeq, SeqStart,
                               TokenLogprobs, plan_digest, plan_of)
from nanofn.state.records import FinishReason, Seq, SeqSpec, SeqStatus
from nanofn.state.requests import InvalidRequest, NewSeq, check_new_seq
from nanofn.state.series import RunSeries, run_series
from nanofn.state.step import Events, step
from nanofn.state.trace import (Trace, TraceError, header_line, parse_trace, read_trace,
                                replay, step_line)
from nanofn.state.trace_diff import TraceDiff, diff_traces

__all__ = [
    "PENDING_TOKEN", "BatchPlan", "Counters", "EngineState", "Events", "Figures", "FinishReason",
    "InvalidRequest", "NewSeq", "SampleOutput", "SamplingParams", "ScheduledSeq", "SeqStart",
    "SchedulerConfig", "Seq", "SeqSpec", "SeqStatus", "TokenLogprobs", "Trace", "TraceError",
    "blocks_for", "check_new_seq", "figures", "header_line", "initial_state", "parse_trace",
    "plan_digest", "plan_of", "read_trace", "replay", "step", "step_line",
    "RunSeries", "TraceDiff", "diff_traces", "run_series",
]
