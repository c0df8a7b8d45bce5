"""An offline vLLM script, as a vLLM user writes it, with only the import changed
(``from vllm import ...`` -> ``from nanofn import ...``). ``tests/test_vllm_parity.py`` runs it
on a tiny checkpoint whose generation_config.json sets temperature 0.6, top_p 0.95, top_k 20,
repetition_penalty 1.1 and max_new_tokens 12. Usage: python vllm_offline_script.py MODEL_DIR"""

import sys

from nanofn import LLM, BeamSearchParams, SamplingParams

llm = LLM(model=sys.argv[1], max_model_len=256, generation_config="auto", seed=0)
tokenizer = llm.get_tokenizer()
assert llm.llm_engine.get_tokenizer() is tokenizer

# generation_config.json gives the defaults.
defaults = llm.get_default_sampling_params()
assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty,
        defaults.max_tokens) == (0.6, 0.95, 20, 1.1, 12)
prompts = ["Hello, my name is", "The capital of France is", "The future of AI is"]
for output in llm.generate(prompts):
    assert 1 <= len(output.outputs[0].token_ids) <= 12

greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
(plain,) = llm.generate(prompts[0], greedy)
first = plain.outputs[0].token_ids

# logit_bias: a large bias makes greedy decoding pick that token every time.
favourite = first[0] + 1
(out,) = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                 logit_bias={favourite: 100.0}))
assert out.outputs[0].token_ids == [favourite] * 6

# allowed_token_ids: sampling never leaves the list.
allowed = [tokenizer.encode(w)[0] for w in (" the", " a", " fox")]
(out,) = llm.generate(prompts[1], SamplingParams(temperature=1.0, max_tokens=10,
                                                 allowed_token_ids=allowed))
assert set(out.outputs[0].token_ids) <= set(allowed)

# bad_words: greedy decoding no longer produces the words it produced unprompted.
word = tokenizer.decode(first[:2])
(out,) = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                 bad_words=[word]))
assert out.outputs[0].token_ids[:2] != first[:2]

# prompt_logprobs: None for the first position, then the prompt token and the top 2.
(out,) = llm.generate(prompts[2], SamplingParams(max_tokens=1, prompt_logprobs=2))
assert out.prompt_logprobs[0] is None
assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
    assert token in entry and 2 <= len(entry) <= 3
    assert {lp.rank for t, lp in entry.items() if t != token} <= {1, 2}
    assert all(lp.logprob <= 0 for lp in entry.values())

# truncate_prompt_tokens keeps the last tokens of the prompt.
(out,) = llm.generate(prompts[1], SamplingParams(max_tokens=2, truncate_prompt_tokens=3))
assert out.prompt_token_ids == tokenizer.encode(prompts[1])[-3:]

# detokenize=False: token ids, no text; spaces_between_special_tokens is accepted.
(out,) = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                 detokenize=False))
assert out.outputs[0].text == "" and out.outputs[0].token_ids == first
(out,) = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                 spaces_between_special_tokens=False))
assert out.outputs[0].text == plain.outputs[0].text

# stop_reason: the stop token id or the stop string; None for a length finish.
(out,) = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8,
                                                 stop_token_ids=[first[2]]))
assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == first[2]
stop = plain.outputs[0].text[3:6]
(out,) = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8, stop=[stop]))
assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
assert plain.outputs[0].finish_reason == "length" and plain.outputs[0].stop_reason is None

# repetition_penalty, and the metrics of a request.
(out,) = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8,
                                                 repetition_penalty=1.5))
m = out.metrics
assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
assert m.last_token_time <= m.finished_time and m.time_in_queue >= 0

# num_cached_tokens and reset_prefix_cache.
long_prompt = "Once upon a time there was a little engine that served many requests " * 3
llm.generate(long_prompt, greedy)
(cached,) = llm.generate(long_prompt, greedy)
assert cached.num_cached_tokens > 0
assert llm.reset_prefix_cache()
(fresh,) = llm.generate(long_prompt, greedy)
assert fresh.num_cached_tokens == 0
assert fresh.outputs[0].token_ids == cached.outputs[0].token_ids

# chat: text parts, chat_template_kwargs, add_generation_prompt, continue_final_message.
messages = [{"role": "user", "content": [{"type": "text", "text": "Hi "},
                                         {"type": "text", "text": "there"}]}]
(out,) = llm.chat(messages, greedy, chat_template_kwargs={"enable_thinking": False})
assert "Hi there" in out.prompt and out.prompt.endswith("<think>\n\n</think>\n\n")
(out,) = llm.chat(messages + [{"role": "assistant", "content": "Well,"}], greedy,
                  add_generation_prompt=False, continue_final_message=True)
assert out.prompt.endswith("Well,")

# beam search with vLLM's BeamSearchParams.
(result,) = llm.beam_search([{"prompt": prompts[0]}],
                            BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.0))
assert len(result.sequences) == 2
print("vLLM script ran")
