"""The user-facing API: LLM, SamplingParams, outputs, stop strings, n, seeds, logprobs, chat,
beam search, the engine-level calls and traces."""

from __future__ import annotations

import json
import math
import weakref
from dataclasses import replace

import pytest

from nanofn import LLM, BeamSearchParams, SamplingParams
from nanofn.engine.engine import Engine
from nanofn.engine.options import EngineOptions
from nanofn.state import InvalidRequest, parse_trace, replay

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = ["Hello world! How are", "The quick brown fox", "Once upon a time there was"]


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    with LLM(str(tiny_qwen3), num_kv_blocks=128, max_model_len=256, seed=0) as llm:
        yield llm


def texts(outputs):
    return [o.outputs[0].text for o in outputs]


# --- construction -------------------------------------------------------------------------

def test_a_closed_llm_is_freed_at_once_without_the_cycle_collector(tiny_qwen3):
    """The engine freezes what it loaded out of the cyclic collector's reach: a reference cycle
    through the engine would keep its weights and KV cache (GPU memory) alive for good."""
    llm = LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=256)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    engine = weakref.ref(llm.engine)
    llm.close()
    del llm
    assert engine() is None


def test_close_lets_go_of_the_weights_and_kv_cache_while_the_llm_is_still_held(tiny_qwen3):
    """A script that makes a second LLM before dropping the first (or keeps it in a variable)
    must not hold two models' GPU memory; a closed LLM says so when used."""
    llm = LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=256)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    runner = llm.engine.runner
    weight = weakref.ref(next(runner.model.parameters()))
    kv_cache = weakref.ref(runner.kv_cache[0])
    llm.close()
    assert weight() is None and kv_cache() is None
    llm.close()  # twice is quiet
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


def test_an_unknown_option_is_an_error_naming_it(tiny_qwen3):
    with pytest.raises(TypeError, match="unknown option.*max_num_sequences"):
        LLM(str(tiny_qwen3), max_num_sequences=4)


def test_a_bad_option_value_names_the_option(tiny_qwen3):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        LLM(str(tiny_qwen3), gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="max_model_len 5000 is longer than the model's"):
        LLM(str(tiny_qwen3), max_model_len=5000)


def test_a_missing_model_folder_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist.*does not exist"):
        LLM(str(tmp_path / "does-not-exist"))
    with pytest.raises(FileNotFoundError, match="config.json.*is missing"):
        LLM(str(tmp_path))


def test_options_have_vllm_defaults():
    o = EngineOptions(model="m")
    assert (o.gpu_memory_utilization, o.max_num_seqs, o.max_num_batched_tokens, o.block_size,
            o.enable_prefix_caching, o.tensor_parallel_size) == (0.9, 512, 16384, 16, True, 1)


# --- generate -----------------------------------------------------------------------------

def test_prompts_as_strings_token_ids_and_dicts_give_the_same_tokens(llm):
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    outs = llm.generate([PROMPTS[0], ids, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[0].prompt == PROMPTS[0] and outs[1].prompt is None
    assert outs[0].prompt_token_ids == ids
    (single,) = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert single.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_outputs_come_back_in_input_order_whatever_the_finishing_order(llm):
    lengths = [12, 2, 7, 1]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate(PROMPTS + ["Paris"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    assert [o.prompt for o in outs] == PROMPTS + ["Paris"]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_nano_vllm_style_access(llm):
    (out,) = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert out["text"] == out.outputs[0].text and out["token_ids"] == out.outputs[0].token_ids
    decoded = llm.get_tokenizer().decode(out["token_ids"], skip_special_tokens=True)
    # The incremental text leaves out a character whose bytes have not all arrived yet.
    assert decoded.rstrip("\ufffd") == out["text"].rstrip("\ufffd")


def test_one_sampling_params_per_prompt_must_match_the_count(llm):
    with pytest.raises(ValueError, match="got 2 sampling params for 3 prompts"):
        llm.generate(PROMPTS, [GREEDY, GREEDY], use_tqdm=False)


def test_a_bad_prompt_is_reported_by_index_and_the_engine_keeps_serving(llm):
    too_long = [5] * 300
    with pytest.raises(ValueError, match="prompt 1: .*longer than max_model_len 256"):
        llm.generate([PROMPTS[0], too_long, PROMPTS[1]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0: .*prompt is empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt token id 99999"):
        llm.generate([[1, 99999]], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == 3


def test_the_progress_bar_reports_requests_and_throughput(llm, capsys):
    llm.generate(PROMPTS, GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "3/3" in err and "prefill" in err and "decode" in err and "tok/s" in err


# --- stop strings, stop tokens, min_tokens ------------------------------------------------

def test_a_stop_string_split_over_tokens_cuts_the_text(llm):
    tokenizer = llm.get_tokenizer()
    (free,) = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    ids = free.outputs[0].token_ids
    # A stop string made of the end of token 3 and the start of token 4.
    left, right = tokenizer.decode(ids[3:4]), tokenizer.decode(ids[4:5])
    assert left and right
    stop = left[-1] + right[0]
    before = tokenizer.decode(ids[:4])
    (cut,) = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10, stop=[stop]),
                          use_tqdm=False)
    c = cut.outputs[0]
    assert c.finish_reason == "stop"
    expected = free.outputs[0].text[:free.outputs[0].text.index(stop)]
    assert c.text == expected and len(expected) <= len(before)
    assert c.token_ids == ids[:len(c.token_ids)] and len(c.token_ids) <= 5
    (kept,) = llm.generate(PROMPTS[:1], SamplingParams(
        temperature=0, max_tokens=10, stop=stop, include_stop_str_in_output=True), use_tqdm=False)
    assert kept.outputs[0].text == expected + stop


def test_stop_token_ids_and_min_tokens(llm):
    (free,) = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    ids = free.outputs[0].token_ids
    stop_at = ids[2]
    (stopped,) = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10,
                                                           stop_token_ids=[stop_at]), use_tqdm=False)
    assert stopped.outputs[0].token_ids == ids[:ids.index(stop_at) + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    # As in vLLM, the stop token's own text is left out, unless asked for.
    before = llm.get_tokenizer().decode(ids[:ids.index(stop_at)])
    assert stopped.outputs[0].text.rstrip("\ufffd") == before.rstrip("\ufffd")
    (kept,) = llm.generate(PROMPTS[:1], SamplingParams(
        temperature=0, max_tokens=10, stop_token_ids=[stop_at], include_stop_str_in_output=True),
        use_tqdm=False)
    with_stop = llm.get_tokenizer().decode(ids[:ids.index(stop_at) + 1])
    assert with_stop.rstrip("\ufffd") != before.rstrip("\ufffd")  # the stop token has text
    assert kept.outputs[0].text.rstrip("\ufffd") == with_stop.rstrip("\ufffd")
    # Before min_tokens the stop token cannot even be sampled.
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at], min_tokens=8)
    (late,) = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert stop_at not in late.outputs[0].token_ids[:8]
    assert len(late.outputs[0].token_ids) >= 8


# --- n, seeds, logprobs -------------------------------------------------------------------

def test_n_samples_differ_share_the_prompt_blocks_and_repeat_with_the_seed(llm):
    prompt = [7] * 40  # two full blocks to share
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=11, ignore_eos=True)
    before = llm.engine.state.counters
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    after = llm.engine.state.counters
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2] and len(set(samples)) == 3
    assert after.num_cached_tokens - before.num_cached_tokens >= 2 * 32
    (again,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert [tuple(c.token_ids) for c in again.outputs] == samples


def test_a_seeded_request_gets_the_same_tokens_alone_or_in_any_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=3, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    (alone,) = llm.generate(PROMPTS[:1], seeded, use_tqdm=False)
    batch = llm.generate(PROMPTS[1:] + PROMPTS[:1], [unseeded, unseeded, seeded], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone.outputs[0].token_ids


def test_logprobs_of_sampled_and_top_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True)
    (out,) = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    total = 0.0
    for token, entry in zip(c.token_ids, c.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy takes the most likely
        assert len(entry) == 3
        assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
        assert all(lp.logprob <= 0 for lp in entry.values())
        total += entry[token].logprob
    assert math.isclose(c.cumulative_logprob, total, rel_tol=1e-6)


def test_top_k_one_is_greedy(llm):
    (greedy,) = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    (top1,) = llm.generate(PROMPTS[:1], SamplingParams(temperature=1.3, top_k=1, max_tokens=10,
                                                       ignore_eos=True), use_tqdm=False)
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids


# --- chat and beam search -----------------------------------------------------------------

def test_chat_goes_through_the_chat_template(llm):
    conversation = [{"role": "user", "content": "Hello"}]
    (out,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert out.prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    two = llm.chat([conversation, conversation + [{"role": "assistant", "content": "Hi"}]],
                   GREEDY, use_tqdm=False)
    assert two[0].outputs[0].token_ids == out.outputs[0].token_ids and len(two) == 2
    (custom,) = llm.chat(conversation, GREEDY, use_tqdm=False,
                         chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert custom.prompt == "[Hello]"


def test_beam_search_returns_the_best_beams_first(llm):
    (result,) = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=3, max_tokens=5))
    beams = result.sequences
    assert len(beams) == 3 and len({b.token_ids for b in beams}) == 3
    assert all(len(b.token_ids) == 5 for b in beams)
    scores = [b.cumulative_logprob for b in beams]
    assert scores == sorted(scores, reverse=True)
    (greedy,) = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5,
                                                         ignore_eos=True, logprobs=0), use_tqdm=False)
    assert beams[0].cumulative_logprob >= greedy.outputs[0].cumulative_logprob - 1e-5
    (one,) = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=1, max_tokens=5))
    assert list(one.sequences[0].token_ids) == greedy.outputs[0].token_ids


def test_beam_search_params_are_validated():
    with pytest.raises(ValueError, match=r"beam_width must be an integer in \[1, 10\]"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        BeamSearchParams(beam_width=2, max_tokens=0)


# --- the engine-level API -----------------------------------------------------------------

def test_add_request_step_abort_and_is_finished(tiny_qwen3):
    engine = Engine(EngineOptions(model=str(tiny_qwen3), num_kv_blocks=64, max_model_len=256))
    long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    a = engine.add_request("Hello", long)
    b = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                           request_id="mine")
    c = engine.add_request("never started", long)
    assert b == "mine" and a != c
    engine.abort_request(c)  # still queued: it never reaches the core
    with pytest.raises(InvalidRequest, match="'mine' is already in use"):
        engine.add_request("x", long, request_id="mine")
    seen = {}
    steps = 0
    while not engine.is_finished():
        result = engine.step()
        steps += 1
        for out in result.outputs:
            seen[out.request_id] = out
        if steps == 4:
            engine.abort_request(a)
    assert seen[c].outputs[0].finish_reason == "abort" and seen[c].outputs[0].token_ids == []
    assert seen["mine"].outputs[0].finish_reason == "length"
    assert len(seen["mine"].outputs[0].token_ids) == 3
    assert seen[a].outputs[0].finish_reason == "abort" and 0 < len(seen[a].outputs[0].token_ids) < 50
    assert engine.state.pool.num_free == engine.state.pool.num_blocks


def test_a_streamed_requests_outputs_share_one_copy_of_its_prompt(tiny_qwen3):
    """One output a step: copying a long prompt into each was most of a server step's output
    work. The copy is the outputs' own: changing it leaves the request's text as it was."""
    engine = Engine(EngineOptions(model=str(tiny_qwen3), num_kv_blocks=64, max_model_len=256))
    prompt = [5, 6, 7, 8]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outputs = []
    while not engine.is_finished():
        outputs += engine.step().outputs
    assert len(outputs) == 6 and outputs[0].prompt_token_ids == prompt
    assert all(o.prompt_token_ids is outputs[0].prompt_token_ids for o in outputs)
    assert outputs[0].prompt_token_ids is not prompt
    expected = outputs[-1].outputs[0].text
    request_id = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6,
                                                           ignore_eos=True))
    first = []
    while not first:
        first = engine.step().outputs
    first[0].prompt_token_ids.clear()
    assert engine._requests[request_id].prompt_token_ids == prompt  # (the engine's own)
    while not engine.is_finished():
        last = engine.step().outputs
    assert last[0].outputs[0].text == expected


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stream_interval_reports_a_streamed_request_every_n_tokens(tiny_qwen3, async_scheduling):
    """At its first token, then once it has 4 new ones, and at its finish; the outputs hold
    what they would at an interval of 1."""
    reported = {}
    for interval in (1, 4):
        engine = Engine(EngineOptions(model=str(tiny_qwen3), num_kv_blocks=64, max_model_len=256,
                                      stream_interval=interval,
                                      async_scheduling=async_scheduling))
        engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=10,
                                                     ignore_eos=True))
        outputs = []
        while not engine.is_finished():
            outputs += engine.step().outputs
        reported[interval] = {len(o.outputs[0].token_ids): o for o in outputs}
    assert list(reported[1]) == list(range(1, 11))
    assert list(reported[4]) == [1, 5, 9, 10]
    for tokens, output in reported[4].items():
        assert output.outputs[0].text == reported[1][tokens].outputs[0].text


def delta_requests(tiny_qwen3) -> list[tuple[list[int], SamplingParams, bool]]:
    """Requests whose deltas take every path: (prompt, params, streamed). A greedy run first
    gives a stop token and a stop string that the later ones meet."""
    engine = Engine(EngineOptions(model=str(tiny_qwen3), num_kv_blocks=64, max_model_len=256))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request([300, 20], greedy, stream=False)
    while not engine.is_finished():
        outputs = engine.step().outputs
    tokens, text = outputs[0].outputs[0].token_ids, outputs[0].outputs[0].text
    engine.close()
    return [
        ([300, 20], greedy, True),
        ([9, 1, 4, 4], SamplingParams(temperature=0.8, seed=7, n=2, logprobs=2, max_tokens=10,
                                      ignore_eos=True), True),
        ([300, 20], replace(greedy, stop_token_ids=[tokens[5]]), True),  # its text shrinks
        ([300, 20], replace(greedy, stop=[text[len(text) // 2:][:2]]), True),
        ([3, 2, 1, 8, 8], SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1), True),
        ([7, 7], SamplingParams(temperature=0, max_tokens=8), False),  # at its finish only
    ]


@pytest.mark.parametrize("interval", [1, 3])
def test_step_deltas_rebuild_the_outputs_step_reports(tiny_qwen3, interval):
    """Twin engines in lockstep: one's ``step()`` outputs, the other's ``step_deltas()``
    applied to the request's previous output, are the same (but the times in the metrics),
    and a streamed request's deltas carry its new tokens only."""
    from nanofn.engine.outputs import apply_delta

    engines = [Engine(EngineOptions(model=str(tiny_qwen3), num_kv_blocks=64, max_model_len=256,
                                    stream_interval=interval)) for _ in range(2)]
    for prompt, params, stream in delta_requests(tiny_qwen3):
        for engine in engines:
            engine.add_request(prompt, params, stream=stream)
    rebuilt, reported, steps = {}, {}, 0
    while not engines[0].is_finished():
        outputs, deltas = engines[0].step().outputs, engines[1].step_deltas().outputs
        assert [d[0] for d in deltas] == [o.request_id for o in outputs]
        for output, delta in zip(outputs, deltas):
            request_id, _, _, metrics, _, finished, changes = delta
            before, previous = rebuilt.get(request_id), reported.get(request_id)
            # the twin's metrics are replaced at the same steps
            assert (metrics is not None) == (previous is None
                                             or output.metrics is not previous.metrics)
            reported[request_id] = output
            if before is not None and not finished:  # the new tokens and logprobs only
                for (tokens, _, logprobs, *_), old in zip(changes, before.outputs):
                    assert tokens[0] == len(old.token_ids) and len(tokens[1]) <= interval
                    if logprobs is not None:
                        assert logprobs[0] == len(old.logprobs)
                        assert len(logprobs[1]) <= interval
            rebuilt[request_id] = apply_delta(delta, before)
            assert replace(rebuilt[request_id], metrics=None) == replace(output, metrics=None)
        steps += 1
    assert engines[1].is_finished() and len(rebuilt) == 6 and steps > 10
    assert all(o.finished for o in rebuilt.values())


def test_a_delta_of_a_text_or_tokens_that_did_not_just_grow_holds_them_whole():
    """Should a finished sequence's text or tokens not extend what its previous delta had
    (none of the engine's paths does so far), its delta holds them whole, and applying it
    gives them as they are."""
    from nanofn.engine.engine import _completion_delta, _SeqOutput
    from nanofn.engine.outputs import CompletionOutput, RequestOutput, apply_delta

    seq = _SeqOutput("0", 0, SamplingParams(), None, [1, 2, 3], None, None,
                     finish_reason="stop", text="abc")
    seq.sent = ([1, 2, 9], 3, "abcd", None, 0)
    change = _completion_delta(seq)
    assert change[:2] == ((0, [1, 2, 3]), (0, "abc"))
    before = RequestOutput("r", None, [7], [CompletionOutput(0, "abcd", [1, 2, 9], None, None)],
                           False)
    after = apply_delta(("r", None, None, None, None, True, [change]), before)
    assert after.outputs[0].token_ids == [1, 2, 3] and after.outputs[0].text == "abc"


def test_stream_interval_must_be_a_positive_integer(tiny_qwen3):
    with pytest.raises(ValueError, match="stream_interval must be a positive integer, got 0"):
        EngineOptions(model=str(tiny_qwen3), stream_interval=0)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_reports_prefill_and_decode_tokens(tiny_qwen3, async_scheduling):
    engine = Engine(EngineOptions(model=str(tiny_qwen3), num_kv_blocks=64, max_model_len=256,
                                  async_scheduling=async_scheduling))
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=3))
    first = engine.step()
    assert (first.num_prefill_tokens, first.num_decode_tokens, first.outputs) == (5, 0, [])
    second = engine.step()
    assert (second.num_prefill_tokens, second.num_decode_tokens) == (0, 1)
    # One step ahead, the second step schedules before the first token is back on the host.
    seen = engine.step().outputs if async_scheduling else second.outputs
    assert len(seen[0].outputs[0].token_ids) == 1 and not seen[0].finished


def test_async_scheduling_gives_the_tokens_of_sync_scheduling(tiny_qwen3):
    """Pending tokens, one-step-late finishing and discarded extra samples change nothing a
    user sees: stop strings, stop tokens, EOS-like stops, lengths, n, seeds."""
    def run(async_scheduling):
        with LLM(str(tiny_qwen3), num_kv_blocks=12, max_model_len=160,
                 async_scheduling=async_scheduling) as llm:
            free = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            stop_token = free[0].outputs[0].token_ids[4]
            params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token]),
                      SamplingParams(temperature=0.9, max_tokens=9, seed=4, n=2),
                      SamplingParams(temperature=0, max_tokens=20, stop=[free[2]["text"][6:9]])]
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]
    sync = run(False)
    assert run(True) == sync
    assert [o[0][2] for o in sync] == ["stop", "length", "stop"]


# --- traces -------------------------------------------------------------------------------

def test_a_recorded_trace_replays_and_checks_clean(tiny_qwen3, tmp_path):
    path = tmp_path / "run.jsonl"
    with LLM(str(tiny_qwen3), num_kv_blocks=6, max_model_len=96, trace=str(path)) as llm:
        outs = llm.generate(PROMPTS * 2, SamplingParams(temperature=0.7, max_tokens=30, seed=1),
                            use_tqdm=False)
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["meta"]["model"] == str(tiny_qwen3)
    trace = parse_trace(lines)
    states = [state for state, _ in replay(trace, check=True)]
    finished = {seq.seq_id: seq for state in states for seq in state.finished}
    assert [list(finished[o.request_id].output_token_ids) for o in outs] == \
        [o.outputs[0].token_ids for o in outs]
    assert states[-1].counters.num_preemptions > 0  # the small pool made it interesting


# --- options that shape the engine --------------------------------------------------------

def test_the_engine_seed_drives_unseeded_sampling(tiny_qwen3):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def sample(seed):
        with LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=256, seed=seed) as llm:
            return [o["token_ids"] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_block_size_kv_cache_bytes_device_and_tokenizer_options(tiny_qwen3, tmp_path):
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tokenizer_dir / name).write_bytes((tiny_qwen3 / name).read_bytes())
    with LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=256) as llm:
        expected = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    # 2 layers x K and V x 2 KV heads x 16 dims x 4 bytes = 512 bytes per token.
    with LLM(str(tiny_qwen3), block_size=32, kv_cache_memory_bytes=40 * 32 * 512,
             max_model_len=256, device="cpu", tokenizer=str(tokenizer_dir)) as llm:
        config = llm.engine.scheduler_config
        assert (config.block_size, llm.engine.state.pool.num_blocks) == (32, 40)
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def test_a_request_id_can_be_reused_while_its_last_token_is_in_flight(tiny_qwen3):
    """With async scheduling a request finishes a step before its last sampled token comes
    back; a new request under the same id must not receive that token."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    fresh = Engine(EngineOptions(model=str(tiny_qwen3), num_kv_blocks=64, max_model_len=256))
    fresh.add_request([5, 6, 7], params, request_id="x")
    expected = _run_to_end(fresh)["x"]
    fresh.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=1), request_id="y")
    first = _run_to_end(fresh)["y"].outputs[0].token_ids[0]
    engine = Engine(EngineOptions(model=str(tiny_qwen3), num_kv_blocks=64, max_model_len=256))
    # It stops on its first token, after the next step was already scheduled one step ahead.
    engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=5,
                                                 stop_token_ids=[first]), request_id="x")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.state.undelivered  # the finished request's extra token is still in flight
    engine.add_request([5, 6, 7], params, request_id="x")
    got = _run_to_end(engine)["x"]
    assert got.request_id == "x"
    assert (got.outputs[0].token_ids, got.outputs[0].text) == \
        (expected.outputs[0].token_ids, expected.outputs[0].text)


def _run_to_end(engine):
    seen = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            seen[out.request_id] = out
    return seen


@pytest.mark.parametrize("bad", [{"prompt_token_ids": 5}, b"abc", 42, {"text": "hi"}])
def test_a_malformed_prompt_is_an_invalid_request_and_nothing_stays_queued(llm, bad):
    with pytest.raises(ValueError, match="prompt 1: .*(a prompt must be|needs 'prompt_token_ids')"):
        llm.generate([PROMPTS[0], bad], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("options, message", [
    (dict(block_size=8), r"block_size must be in \[16, 256\]"),
    (dict(max_num_seqs=64, max_num_batched_tokens=32), "must be >= max_num_seqs"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=64, max_num_seqs=4,
          max_model_len=256),
     "without chunked prefill"),
    (dict(num_kv_blocks=2, max_model_len=256), r"2 blocks of 16 tokens cannot hold one"),
    (dict(seed="x"), "seed must be an integer or None"),
    (dict(enforce_eager=1), "enforce_eager must be True or False"),
    (dict(kernel_backend="cuda"), "kernel_backend must be one of auto, torch, triton, flash"),
    (dict(device="tpu"), "device must be 'auto', 'cpu' or 'cuda"),
])
def test_bad_engine_options_name_the_problem(tiny_qwen3, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_qwen3), **options)


def test_text_is_decoded_once_at_the_end_unless_stop_strings_need_it(llm, monkeypatch):
    """Detokenization is off the per-step path: a request without stop strings (or logprobs)
    is decoded once when it finishes, to the text incremental decoding gives."""
    import nanofn.engine.engine as engine_module
    from nanofn.engine.detokenizer import Detokenizer

    per_step, finals, ending = [], [], []
    original_add, original_decode = Detokenizer.add, engine_module.decode_output

    def counting_add(self, *a, **k):
        (finals if ending else per_step).append(1)
        return original_add(self, *a, **k)

    def counting_decode(*a, **k):
        ending.append(1)
        try:
            return original_decode(*a, **k)
        finally:
            ending.pop()

    monkeypatch.setattr(Detokenizer, "add", counting_add)
    monkeypatch.setattr(engine_module, "decode_output", counting_decode)
    plain = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not per_step
    watched = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                   stop=["\x00 never"]), use_tqdm=False)
    assert len(per_step) == 10 * len(PROMPTS)
    assert texts(plain) == texts(watched) and all(texts(plain))


def test_a_batch_caller_can_decode_finished_texts_after_the_last_step(tiny_qwen3):
    engine = Engine(EngineOptions(model=str(tiny_qwen3), num_kv_blocks=64, max_model_len=256))
    engine.add_request("Hello", GREEDY, request_id="a", stream=False)
    engine.add_request("Hello", replace(GREEDY, stop=["\x00 never"]), request_id="b")
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step(only_finished=True, decode_finished=False).outputs
    texts_now = {o.request_id: o.outputs[0].text for o in finished}
    assert texts_now["a"] == "" and texts_now["b"]  # b's stop strings needed its text already
    engine.decode_texts(finished)
    assert {o.request_id: o.outputs[0].text for o in finished} == {"a": texts_now["b"],
                                                                   "b": texts_now["b"]}


def test_texts_left_for_later_are_decoded_while_the_device_is_busy_and_no_longer(
        tiny_qwen3, monkeypatch):
    """The steps decode the finished texts left for later only while the device computes (a
    CPU runner is never busy after a launch; here the loop says it is for three checks)."""
    engine = Engine(EngineOptions(model=str(tiny_qwen3), num_kv_blocks=64, max_model_len=256))
    import nanofn.engine.engine as engine_module

    for i, n in enumerate((1, 1, 1, 1, 1, 4)):
        engine.add_request("Hello", replace(GREEDY, max_tokens=n), request_id=str(i), stream=False)
    busy = iter([True] * 3)
    monkeypatch.setattr(engine.loop, "device_busy", lambda: next(busy, False))
    decoded = []
    decode = engine_module.decode_output
    monkeypatch.setattr(engine_module, "decode_output",
                        lambda *a: decoded.append(a) or decode(*a))
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step(only_finished=True, decode_finished=False).outputs
    assert len(decoded) == 3  # three of the five short ones, while the device was "busy"
    engine.decode_texts(finished)
    assert len(decoded) == 6 and all(o.outputs[0].text for o in finished)


def test_an_eager_steps_device_interval_opens_after_its_inputs_are_laid_out(tiny_qwen3,
                                                                            monkeypatch):
    """The busy-time timeline must not count, as the step's, the time an idle device waits for
    the host to lay out an eager step's inputs: each interval's opening mark comes after the
    step's ``prepare_inputs`` (a fake timeline records the order; on a CPU every step is eager)."""
    import nanofn.runner.model_runner as model_runner

    calls: list[str] = []
    prepare = model_runner.prepare_inputs

    def recorded_prepare(*args, **kwargs):
        calls.append("prepare")
        return prepare(*args, **kwargs)

    class Timeline:
        def mark(self):
            calls.append("mark")
            return len(calls) - 1  # the mark's place in the calls

        def add(self, start, label):
            calls.append(("interval", start))

    monkeypatch.setattr(model_runner, "prepare_inputs", recorded_prepare)
    with LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=256) as llm:
        llm.engine.runner.timeline = Timeline()
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    intervals = [call[1] for call in calls if isinstance(call, tuple)]
    assert len(intervals) >= 3  # a prefill, then decode steps
    for opening in intervals:
        assert calls[opening] == "mark" and calls[opening - 1] == "prepare"


def test_a_step_queues_the_model_before_recording_the_new_sequences_sampling_parameters(
        llm, monkeypatch):
    """Only sampling reads a starting sequence's parameters; the runner records them (their
    copies to the device included) once the model's work is queued, so that a prefill does not
    wait for them to start."""
    runner = llm.engine.loop.runner
    calls = []
    model_forward, start = runner.model.forward, runner._start
    monkeypatch.setattr(runner.model, "forward",
                        lambda *a, **k: (calls.append("model"), model_forward(*a, **k))[1])
    monkeypatch.setattr(runner, "_start",
                        lambda started: (calls.append("start"), start(started))[1])
    llm.generate(["order"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert calls == ["model", "start"]


def timed_steps(model_dir, **options) -> tuple[dict, float, float]:
    """``bench.measure`` of a small workload with the runner's own timeline: the timeline's
    steps by label, its busy seconds and the run's elapsed seconds."""
    from nanofn.cli.bench import measure, standard_workload

    with LLM(str(model_dir), num_kv_blocks=24, max_model_len=96, max_num_seqs=4,
             **options) as llm:
        timeline = llm.engine.runner.new_timeline()
        workload = standard_workload(6, 40, 12, vocab_size=llm.engine.text_config.vocab_size)
        result = measure(llm, workload, timeline)
        assert llm.engine.runner.timeline is None  # (detached after the run)
        steps = {label: n for label, (n, _, _) in timeline.by_label().items() if n}
        return steps, result.device_busy_s, result.elapsed_s


def test_rank_0_keeps_the_device_timeline_of_a_tensor_parallel_run(tiny_qwen3):
    """With two ranks (gloo on the CPU), the timeline lives in rank 0's process and reports
    back: the same steps by kind as one rank's own, busy for part of the run."""
    one_rank, _, _ = timed_steps(tiny_qwen3)
    two_ranks, busy, elapsed = timed_steps(tiny_qwen3, tensor_parallel_size=2)
    assert two_ranks == one_rank and sum(one_rank.values()) > 6
    assert 0 < busy <= elapsed
