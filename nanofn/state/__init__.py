"""The pure engine core: records, block pool, prefix cache, scheduler, step and traces.

Nothing here imports torch, touches files, reads clocks or draws random numbers: every
function maps immutable records to new immutable records.
"""

from nanofn.state.config import SchedulerConfig
from nanofn.state.engine_state import EngineState, Stats, initial_state
from nanofn.state.figures import Figures, figures
from nanofn.state.params import SamplingParams
from nanofn.state.plan import BatchPlan, ScheduledSeq, plan_digest
from nanofn.state.records import FinishReason, Request, Seq, SeqStatus
from nanofn.state.requests import InvalidRequest, NewRequest, check_new_request
from nanofn.state.step import Events, step
from nanofn.state.trace import Trace, TraceError, header_line, parse_trace, replay, step_line

__all__ = [
    "BatchPlan", "EngineState", "Events", "Figures", "FinishReason", "InvalidRequest",
    "NewRequest", "Request", "SamplingParams", "ScheduledSeq", "SchedulerConfig", "Seq",
    "SeqStatus", "Stats", "Trace", "TraceError", "check_new_request", "figures", "header_line",
    "initial_state", "parse_trace", "plan_digest", "replay", "step", "step_line",
]
