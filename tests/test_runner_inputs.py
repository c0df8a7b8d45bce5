"""From plans to model inputs: positions, cache slots, sample rows, and the per-slot block
tables and last tokens kept on the device."""

from __future__ import annotations

import torch
from triton_interpreter import interpreter_process

from nanofn.runner.inputs import SlotTables, prepare_inputs
from nanofn.state import PENDING_TOKEN, SamplingParams, ScheduledSeq, SeqStart, plan_of

BS = 16
CPU = torch.device("cpu")
PARAMS = SamplingParams()


def seq(seq_id, slot, start, tokens, new_blocks=(), sample=True, first_column=0):
    return ScheduledSeq(seq_id, slot, tuple(tokens), start, sample,
                        tuple(enumerate(new_blocks, start=first_column)))


def started(*seqs):
    return [SeqStart(s.slot, s.seq_id, PARAMS, 1) for s in seqs]


def slots_of(table, start, count):
    return [table[p // BS] * BS + p % BS for p in range(start, start + count)]


def test_prefill_and_decode_tokens_land_in_their_slots():
    seqs = [seq("a", 2, 0, range(20), [7, 3]), seq("b", 0, 33, [5], [1, 9, 4]),
            seq("c", 1, 16, range(10), [2, 8], sample=False)]
    tables = SlotTables(4, 8, CPU)
    inputs = prepare_inputs(plan_of(1, seqs, started(*seqs)), BS, tables, CPU)
    assert inputs.input_ids.tolist() == list(range(20)) + [5] + list(range(10))
    assert inputs.positions.tolist() == list(range(20)) + [33] + list(range(16, 26))
    assert inputs.batch.slot_mapping.tolist() == (slots_of([7, 3], 0, 20) + slots_of([1, 9, 4], 33, 1)
                                                  + slots_of([2, 8], 16, 10))
    assert inputs.sample_rows.tolist() == [19, 20]  # c's chunk does not end its prompt
    assert inputs.sampling_slots.tolist() == [2, 0]
    assert inputs.batch.query_start.tolist() == [0, 20, 21, 31]
    assert inputs.batch.seq_lens.tolist() == [20, 34, 26]
    assert inputs.batch.block_tables.tolist() == [[7, 3, 0], [1, 9, 4], [2, 8, 0]]
    assert not inputs.batch.decode_only


def test_block_tables_grow_by_appends_and_a_started_slot_starts_afresh():
    tables = SlotTables(2, 4, CPU)
    first = [seq("a", 0, 15, [1], [6]), seq("b", 1, 0, [2], [5])]
    assert prepare_inputs(plan_of(1, first, started(*first)), BS, tables, CPU) \
        .batch.block_tables.tolist() == [[6], [5]]
    # a grows a block; b left (say, preempted) and c takes its slot with a table of its own.
    second = [seq("a", 0, 16, [3], [2], first_column=1), seq("c", 1, 0, [4], [9])]
    inputs = prepare_inputs(plan_of(2, second, started(second[1])), BS, tables, CPU)
    assert inputs.batch.block_tables.tolist() == [[6, 2], [9, 0]]
    assert inputs.batch.slot_mapping.tolist() == [2 * BS, 9 * BS]
    assert inputs.batch.decode_only


def test_a_pending_token_is_the_last_token_sampled_in_its_slot():
    tables = SlotTables(4, 4, CPU)
    tables.keep_sampled(torch.tensor([3, 0]), torch.tensor([72, 70]))
    seqs = [seq("a", 3, 5, [PENDING_TOKEN], [3]), seq("c", 1, 0, [9, 8], [1]),
            seq("b", 0, 17, [PENDING_TOKEN], [4, 5])]
    inputs = prepare_inputs(plan_of(2, seqs, started(seqs[1])), BS, tables, CPU)
    assert inputs.input_ids.tolist() == [72, 9, 8, 70]
    assert inputs.positions.tolist() == [5, 0, 1, 17]


def decode_inputs_and_tables(fields, tables, block_size, query_start):
    """``decode_inputs`` and the tables it wrote (from the interpreter's child)."""
    from nanofn.runner.cuda_graphs import decode_inputs

    return *decode_inputs(fields, tables, block_size, query_start), tables.table


def test_the_decode_graphs_inputs_are_the_eager_inputs():
    """What a CUDA graph's replay computes from the one copied buffer (its Triton kernels run
    in the interpreter here) equals what the eager path computes from the plan: tokens (pending
    ones resolved), positions, cache slots, sequence lengths and block tables; padding rows
    write nowhere."""
    import numpy as np

    from nanofn.runner.cuda_graphs import DECODE_ORDER, NUM_FIELDS, fill_fields

    eager, graph = SlotTables(8, 4, CPU), SlotTables(8, 4, CPU)
    first = [seq("a", 3, 0, range(17), [5, 6]), seq("b", 1, 0, range(3), [2])]
    for tables in (eager, graph):
        prepare_inputs(plan_of(1, first, started(*first)), BS, tables, CPU)
        tables.keep_sampled(torch.tensor([3, 1]), torch.tensor([40, 41]))
    decode = [seq("a", 3, 17, [PENDING_TOKEN]), seq("b", 1, 15, [9], [7], first_column=1)]
    plan = plan_of(2, decode)
    expected = prepare_inputs(plan, BS, eager, CPU)
    fields = np.zeros((NUM_FIELDS, 4), np.int32)
    fill_fields(fields, plan, size=4, spare_slot=8)
    with interpreter_process() as interpreter:
        ids, positions, batch, graph_table = interpreter(
            decode_inputs_and_tables, torch.from_numpy(fields), graph, BS,
            torch.arange(5, dtype=torch.int32))
    assert ids[:2].tolist() == expected.input_ids.tolist() == [40, 9]
    assert positions[:2].tolist() == expected.positions.tolist()
    assert batch.slot_mapping.tolist() == expected.batch.slot_mapping.tolist() + [-1, -1]
    assert batch.seq_lens.tolist() == expected.batch.seq_lens.tolist() + [0, 0]
    assert batch.block_tables[:2, :2].tolist() == expected.batch.block_tables.tolist()
    assert torch.equal(graph_table[:8], eager.table[:8])  # the spare row took the padding
    assert batch.decode_order.tolist() == [0, 1, 3, 2]  # longest context first, padding last
    fill_fields(fields, plan_of(2, decode[::-1]), size=4, spare_slot=8)
    assert fields[DECODE_ORDER].tolist() == [1, 0, 3, 2]


def test_the_prefill_graphs_inputs_are_the_eager_inputs():
    """The same for a prefill graph: a chunk after a cached prefix, a whole prompt and a
    decode row with a pending token, padded to 64 token rows and 8 sequences; the tile map
    is the eager one followed by padding tiles."""
    import numpy as np

    from nanofn.kernels.triton_attention import prefill_tile_map
    from nanofn.runner.prefill_graphs import (PREFILL_GRAPH_SEQS, SAMPLE_ROW, SAMPLING_SLOT,
                                              InputLayout, fill_prefill_inputs,
                                              graph_prefill_inputs, tiles_for)

    eager, graph = SlotTables(8, 4, CPU), SlotTables(8, 4, CPU)
    for tables in (eager, graph):
        tables.keep_sampled(torch.tensor([5]), torch.tensor([77]))
    seqs = [seq("a", 3, 16, range(20), [5, 6, 2]), seq("b", 5, 9, [PENDING_TOKEN], [4]),
            seq("c", 1, 0, range(7), [8], sample=False)]
    plan = plan_of(1, seqs, started(seqs[0], seqs[2]))
    expected = prepare_inputs(plan, BS, eager, CPU)
    layout = InputLayout(max_tokens=64, max_entries=PREFILL_GRAPH_SEQS * 4, min_block_q=4)
    flat = np.zeros(layout.size, np.int32)
    fill_prefill_inputs(flat, layout, plan, spare_slot=8, block_q=8)
    views = layout.views(torch.from_numpy(flat))
    ids, positions, batch = graph_prefill_inputs(views, graph, BS, 32, tiles_for(32, 8))
    t, n = plan.num_tokens, len(seqs)
    assert ids[:t].tolist() == expected.input_ids.tolist()
    assert 77 in ids[:t].tolist()
    assert positions[:t].tolist() == expected.positions.tolist()
    assert batch.slot_mapping.tolist() == expected.batch.slot_mapping.tolist() + [-1] * (32 - t)
    assert batch.query_start.tolist() == expected.batch.query_start.tolist() + [t] * (8 - n)
    assert batch.seq_lens.tolist() == expected.batch.seq_lens.tolist() + [0] * (8 - n)
    width = expected.batch.block_tables.shape[1]
    assert batch.block_tables[:n, :width].tolist() == expected.batch.block_tables.tolist()
    assert torch.equal(graph.table[:8], eager.table[:8])  # the spare row took the padding
    work = prefill_tile_map(expected.batch.query_lens_host, expected.batch.seq_lens_host, 8)
    tiles = batch.prefill_tiles.tolist()
    assert tiles[:len(work)] == work.tolist() and len(tiles) == 32 // 8 + PREFILL_GRAPH_SEQS
    assert all(tile == [-1, 0] for tile in tiles[len(work):])
    s = len(plan.sampling_seq_ids)
    assert views[1][SAMPLE_ROW, :s].tolist() == expected.sample_rows.tolist()
    assert views[1][SAMPLING_SLOT, :s].tolist() == expected.sampling_slots.tolist()
