"""From plans to model inputs: positions, cache slots, sample rows and the block tables kept on
the device by appends."""

from __future__ import annotations

import torch
from pyrsistent import pvector

from nanofn.runner.block_tables import DeviceBlockTables
from nanofn.runner.inputs import PreviousSamples, prepare_inputs
from nanofn.state import BatchPlan, SamplingParams, ScheduledSeq
from nanofn.state.plan import PENDING_TOKEN

BS = 16
CPU = torch.device("cpu")
PARAMS = SamplingParams()


def seq(seq_id, start, tokens, table, sample=True):
    return ScheduledSeq(seq_id, tuple(tokens), start, pvector(table), sample, PARAMS, 1)


def expected_slots(s: ScheduledSeq) -> list[int]:
    return [s.block_table[p // BS] * BS + p % BS for p in range(s.start_pos, s.context_len)]


def test_prefill_and_decode_tokens_land_in_their_slots():
    seqs = (seq("a", 0, range(20), [7, 3]), seq("b", 33, [5], [1, 9, 4]),
            seq("c", 16, range(10), [2, 8], sample=False))
    tables = DeviceBlockTables(4, 8, CPU)
    inputs = prepare_inputs(BatchPlan(1, seqs), BS, tables, CPU)
    assert inputs.input_ids.tolist() == list(range(20)) + [5] + list(range(10))
    assert inputs.positions.tolist() == list(range(20)) + [33] + list(range(16, 26))
    assert inputs.batch.slot_mapping.tolist() == sum((expected_slots(s) for s in seqs), [])
    assert inputs.sample_rows.tolist() == [19, 20]  # c's chunk does not end its prompt
    assert inputs.batch.query_start.tolist() == [0, 20, 21, 31]
    assert inputs.batch.seq_lens.tolist() == [20, 34, 26]
    assert inputs.batch.block_tables.tolist() == [[7, 3, 0], [1, 9, 4], [2, 8, 0]]
    assert not inputs.batch.decode_only


def test_block_tables_grow_by_appends_and_rows_are_reused_after_release():
    tables = DeviceBlockTables(2, 4, CPU)
    first = prepare_inputs(BatchPlan(1, (seq("a", 15, [1], [6]), seq("b", 0, [2], [5]))), BS,
                           tables, CPU)
    assert first.batch.block_tables.tolist() == [[6], [5]]
    # a grows a block; b is released (say, preempted) and c takes its row.
    plan = BatchPlan(2, (seq("a", 16, [3], [6, 2]), seq("c", 0, [4], [9])), released=("b",))
    second = prepare_inputs(plan, BS, tables, CPU)
    assert second.batch.block_tables.tolist() == [[6, 2], [9, 0]]
    assert second.batch.slot_mapping.tolist() == [2 * BS, 9 * BS]
    assert second.batch.decode_only
    # b comes back with a new table: written whole, not appended to its old one.
    back = BatchPlan(3, (seq("b", 0, [1] * 17, [1, 7]),), released=("c",))
    assert prepare_inputs(back, BS, tables, CPU).batch.block_tables.tolist() == [[1, 7]]


def test_a_pending_token_is_read_from_the_previous_samples_on_the_device():
    tables = DeviceBlockTables(4, 4, CPU)
    previous = PreviousSamples(torch.tensor([70, 71, 72]), {"a": 2, "b": 0})
    plan = BatchPlan(2, (seq("a", 5, [PENDING_TOKEN], [3]), seq("c", 0, [9, 8], [1]),
                             seq("b", 17, [PENDING_TOKEN], [4, 5])))
    inputs = prepare_inputs(plan, BS, tables, CPU, previous)
    assert inputs.input_ids.tolist() == [72, 9, 8, 70]
    assert inputs.positions.tolist() == [5, 0, 1, 17]
