"""Temporary: where does TP=2 on two GPUs spend its time or wait?"""
import sys, time
t0 = time.monotonic()
def say(*a):
    print(f"[{time.monotonic() - t0:7.2f} s]", *a, flush=True)

if __name__ == "__main__":
    from nanofn import LLM, SamplingParams
    from nanofn.model.tiny import make_tiny_checkpoint
    import pathlib, tempfile
    folder = pathlib.Path(tempfile.mkdtemp()) / "tiny"
    make_tiny_checkpoint(folder)
    say("checkpoint made")
    for eager in (False, True):
        llm = LLM(str(folder), dtype="float32", gpu_memory_utilization=0.3, max_model_len=512,
                  tensor_parallel_size=2, enforce_eager=eager)
        say("LLM up, enforce_eager", eager)
        outs = llm.generate(["hello world"] * 12, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        say("generated", outs[0].outputs[0].token_ids[:8])
        llm.close()
        say("closed")
