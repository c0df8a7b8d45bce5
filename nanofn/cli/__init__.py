"""The ``nanofn`` command: ``generate`` text, ``serve`` the OpenAI API, ``bench`` throughput,
``replay`` a trace, ``diff`` two traces.

Problems with what the user asked for (a bad flag value, a missing model folder, an unreadable
trace) are reported in one line on stderr with exit code 2, a mistyped flag or command with the
closest one; Ctrl-C in one line with exit code 130. torch is imported only by the subcommands
that run a model, so ``--help`` and ``replay`` start fast.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from nanofn import __version__
from nanofn.engine.options import EngineOptions
from nanofn.server.limits import ServerLimits
from nanofn.cli.bench import (CPU_SHARED_PREFIX_SIZES, CPU_SIZES, KNOWN_DEVICE_RATES,
                              SHARED_PREFIX_SIZES, STANDARD_SIZES, ModelDims, Workload,
                              bench_data_types, describe_sizes, device_rates, floor,
                              format_seconds, measure, shared_prefix_workload,
                              standard_workload)
from nanofn.model.tiny import DEMO_MODEL, demo_model, random_weights_model
from nanofn.state import (EngineState, SamplingParams, Seq, Trace, TraceError, diff_traces,
                          figures, read_trace, replay, run_series)
from nanofn.state.plan import PENDING_TOKEN, BatchPlan, ScheduledSeq

DEFAULT_PROMPTS = ["Hello, my name is", "The capital of France is"]
SHOWN_ITEMS = 12  # a longer list of tokens or blocks is shortened to its ends

# EngineOptions field -> argparse settings; a flag the user leaves out is None and not passed,
# so that LLM keeps its own default.
ENGINE_FLAGS: dict[str, dict[str, Any]] = {
    "tokenizer": dict(metavar="FOLDER", help="a tokenizer folder other than the model's"),
    "seed": dict(type=int, metavar="N",
                 help="the engine's seed, of the sampling of requests without a seed of their "
                      "own (default: {default})"),
    "max_model_len": dict(type=int, metavar="N",
                          help="longest prompt + output (default: the model's "
                               "max_position_embeddings)"),
    "dtype": dict(choices=["auto", "float16", "bfloat16", "float32"],
                  help="weight and KV cache dtype (default: {default}, the checkpoint's)"),
    "device": dict(help="auto, cpu, cuda or cuda:N (default: {default}: cuda when there is a GPU)"),
    "max_num_seqs": dict(type=int, metavar="N",
                         help="most sequences per step (default: {default})"),
    "max_num_batched_tokens": dict(type=int, metavar="N",
                                   help="most tokens per step (default: {default})"),
    "block_size": dict(type=int, metavar="N",
                       help="tokens per KV cache block (default: {default})"),
    "gpu_memory_utilization": dict(type=float, metavar="F",
                                   help="share of GPU memory for weights, activations and KV "
                                        "cache (default: {default})"),
    "tensor_parallel_size": dict(type=int, metavar="N", help="GPUs to split the model over "
                                                             "(default: {default})"),
    "enforce_eager": dict(action="store_const", const=True,
                          help="run the model eagerly, without CUDA graphs"),
    "stream_interval": dict(type=int, metavar="N",
                            help="serve: stream a request's tokens N at a time after its first "
                                 "(default: {default}, each as it comes)"),
    "disable_custom_all_reduce": dict(action="store_const", const=True,
                                      help="tensor parallelism: every all-reduce through NCCL, "
                                           "none through peer memory"),
    "enable_expert_parallel": dict(action="store_const", const=True,
                                   help="tensor parallelism of a mixture-of-experts model: each "
                                        "GPU holds whole experts, not a share of every one"),
    "enable_prefix_caching": dict(flag="--no-prefix-caching", action="store_const", const=False,
                                  help="do not reuse the KV cache of shared prompt prefixes"),
    "enable_chunked_prefill": dict(flag="--no-chunked-prefill", action="store_const",
                                   const=False, help="compute each prompt in one step"),
    "kv_cache_memory_bytes": dict(type=int, metavar="BYTES",
                                  help="KV cache size in bytes (default: from "
                                       "--gpu-memory-utilization on a GPU, 4 GiB on a CPU)"),
    "num_kv_blocks": dict(type=int, metavar="N", help="exact number of KV cache blocks"),
    "load_format": dict(choices=["auto", "safetensors", "dummy"],
                        help="auto: the checkpoint's safetensors; dummy: random weights made on "
                             "the device from config.json alone, for benchmarks (default: "
                             "{default})"),
    "num_state_slots": dict(type=int, metavar="N",
                            help="exact number of a hybrid model's recurrent-state slots "
                                 "(running sequences' states and saved prefix states)"),
    "async_scheduling": dict(flag="--no-async-scheduling", action="store_const", const=False,
                             help="schedule each step only after the previous one's tokens "
                                  "are known (simpler traces, slower)"),
    "kernel_backend": dict(choices=["auto", "torch", "triton", "flash"],
                           help="kernels for attention, norms, rotary and activation (default: "
                                "{default}: on CUDA flash, flash-attn-4's prefill with triton, "
                                "where it runs, else triton; the torch references on a CPU)"),
    "trace": dict(metavar="PATH", help="record the run's trace here, for `nanofn replay`"),
    "generation_config": dict(metavar="auto|vllm|FOLDER",
                              help="sampling defaults: auto, the model's generation_config.json; "
                                   "vllm, none; or a folder's (default: {default})"),
    "nnodes": dict(type=int, metavar="N",
                   help="hosts to split the tensor-parallel ranks over (default: {default}); "
                        "node 0 runs the engine, the others `nanofn worker`"),
    "node_rank": dict(type=int, metavar="K",
                      help="this host's node (default: {default}); above 0 this command runs "
                           "this host's workers only, as `nanofn worker` does"),
    "master_addr": dict(metavar="ADDR", help="node 0's address, where every host meets "
                                             "(default: {default})"),
    "master_port": dict(type=int, metavar="PORT",
                        help="a free port on node 0 for the hosts' rendezvous (torch.distributed's "
                             "store); needed with --nnodes above 1"),
    "quantization": dict(choices=["fp8"],
                         help="fp8: quantize a bf16 checkpoint's attention and MLP projections "
                              "to FP8 as it loads (per output channel, dynamic per-token "
                              "activations); FP8 checkpoints need no flag"),
    "kv_cache_dtype": dict(choices=["auto", "fp8", "fp8_e4m3"],
                           help="KV cache entries: auto, the model's dtype; fp8 (e4m3), one "
                                "byte each, twice the tokens in the same memory (default: "
                                "{default})"),
    "cpu_threads": dict(type=int, metavar="N",
                        help="torch threads on a CPU device (default: 1 for models of hidden "
                             "size under 1024, such as the demo; else torch's, one per core)"),
}

# SamplingParams field -> argparse settings, as for ENGINE_FLAGS ("dest" where the field's name
# is an engine flag's too).
SAMPLING_FLAGS: dict[str, dict[str, Any]] = {
    "max_tokens": dict(type=int, metavar="N", help="most tokens to generate (default: {default})"),
    "temperature": dict(type=float, metavar="T", help="0 is greedy (default: {default})"),
    "top_p": dict(type=float, metavar="P",
                  help="nucleus sampling mass, in (0, 1] (default: {default})"),
    "top_k": dict(type=int, metavar="K", help="sample among the K likeliest tokens; 0 or -1: "
                                             "all (default: {default})"),
    "min_p": dict(type=float, metavar="P", help="drop tokens less likely than P times the "
                                               "likeliest (default: {default})"),
    # --seed is the engine's, as in vLLM
    "seed": dict(flag="--sampling-seed", dest="sampling_seed", type=int, metavar="N",
                 help="each prompt's own sampling seed: its tokens do not depend on what else "
                      "runs (default: none, the engine's --seed)"),
    "n": dict(type=int, metavar="N", help="outputs per prompt (default: {default})"),
    "stop": dict(flag="--stop", action="append", metavar="TEXT",
                 help="stop when the output contains TEXT (repeatable)"),
    "stop_token_ids": dict(flag="--stop-token-id", action="append", type=int, metavar="ID",
                           help="stop after generating token ID (repeatable)"),
    "ignore_eos": dict(action="store_const", const=True,
                       help="keep generating after an end-of-sequence token"),
    "min_tokens": dict(type=int, metavar="N", help="generate at least N tokens before any "
                                                  "stop (default: {default})"),
    "presence_penalty": dict(type=float, metavar="F", help="lower the logits of tokens already "
                                                          "generated by F, in [-2, 2] "
                                                          "(default: {default})"),
    "frequency_penalty": dict(type=float, metavar="F", help="lower them by F per occurrence, "
                                                           "in [-2, 2] (default: {default})"),
    "repetition_penalty": dict(type=float, metavar="F", help="scale down the logits of tokens "
                                                            "in the prompt or output, F > 0; 1 "
                                                            "is none (default: {default})"),
    "logprobs": dict(type=int, metavar="N", help="also compute the log-probabilities of the "
                                                "N likeliest tokens, and print the output's"),
}


# ServerLimits field -> argparse settings, as for ENGINE_FLAGS.
SERVER_FLAGS: dict[str, dict[str, Any]] = {
    "max_n": dict(type=int, metavar="N",
                  help="most sequences one request may start: n, times the prompts of a batched "
                       "completion (default: {default})"),
    "max_request_body_bytes": dict(type=int, metavar="BYTES",
                                   help="a larger request body is refused (413) before it is "
                                        "read (default: {default}, 32 MiB)"),
    "max_chars_per_token": dict(type=int, metavar="N",
                                help="a prompt of more than max_model_len x N characters is "
                                     "refused without tokenizing it (default: {default})"),
    "shutdown_timeout": dict(type=float, metavar="SECONDS",
                             help="after SIGTERM, the requests in flight get this long to "
                                  "finish; then each ends with a 503 (default: {default})"),
}


class UsageError(Exception):
    """A problem with what the user asked for: reported in one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    """Run the ``nanofn`` command line; return its exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a malformed command line (argparse said why)
        return int(e.code or 0)
    try:
        return args.run(args)
    except UsageError as e:
        print(f"nanofn {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the work in flight was settled on the way out
        print(f"nanofn {args.command}: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports a command that Ctrl-C stopped
    except BrokenPipeError:  # the reader went away (``nanofn replay t.jsonl | head``)
        sys.stderr.close()
        return 0


class Parser(argparse.ArgumentParser):
    """argparse's parser, with the closest valid word offered for a mistyped one ("did you
    mean --max-tokens?"): a command, a choice or a flag.

    A subcommand's parser reports its unknown flags itself, with its own usage: argparse would
    hand them back to the top level, whose usage says nothing about them.
    """

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        parsed, unknown = super().parse_known_args(args, namespace)
        if unknown:
            flags = [word.split("=", 1)[0] for word in unknown if word.startswith("-")]
            hint = _did_you_mean(flags[0], self._option_string_actions) if flags else ""
            self.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
        return parsed, unknown

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as e:  # not one of the choices
            hint = _did_you_mean(str(value), map(str, action.choices))
            raise argparse.ArgumentError(action, e.message + hint) from None


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    closest = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {closest[0]}?" if closest else ""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="nanofn", description="nanofn: an LLM inference engine with a pure, replayable "
                                   "scheduling core.")
    parser.add_argument("--version", action="version", version=f"nanofn {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(commands)
    _add_serve(commands)
    _add_bench(commands)
    _add_worker(commands)
    _add_replay(commands)
    _add_diff(commands)
    return parser


# --- shared flags ---------------------------------------------------------------------------

def add_flags(parser: argparse.ArgumentParser, title: str, flags: dict[str, dict[str, Any]],
              fields_of: type) -> None:
    """Add a group of flags named after the fields of ``fields_of`` they set
    (``--max-model-len`` sets ``max_model_len``), unless their settings name another ``flag``
    (and ``dest``); they default to None, meaning "not given". A help text's ``{default}``
    shows the field's default, read from ``fields_of``."""
    defaults = {f.name: f.default for f in fields(fields_of)}
    group = parser.add_argument_group(title)
    for name, settings in flags.items():
        settings = {"dest": name, **settings}
        flag = settings.pop("flag", "--" + name.replace("_", "-"))
        settings["help"] = settings["help"].replace("{default}", str(defaults[name]))
        group.add_argument(flag, default=None, **settings)


def given(args: argparse.Namespace, flags: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The flags of ``flags`` that the user gave, by field name."""
    values = {name: getattr(args, settings.get("dest", name)) for name, settings in flags.items()}
    return {name: value for name, value in values.items() if value is not None}


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM`` keyword arguments from the engine flags the user gave."""
    return given(args, ENGINE_FLAGS)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    with _user_errors():
        return SamplingParams(**given(args, SAMPLING_FLAGS))


def load_llm(model: str | Path, args: argparse.Namespace) -> Any:
    from nanofn.llm import LLM

    with _user_errors():
        return LLM(str(model), **engine_kwargs(args))


@contextmanager
def _user_errors() -> Iterator[None]:
    """Bad option values, missing or unreadable model files become one-line errors, not
    tracebacks."""
    try:
        yield
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from e


# --- the demo model -------------------------------------------------------------------------

def announced_demo_model() -> Path:
    """The built-in demo model's folder, with a word on what it is and how to run a real one."""
    path = demo_model()
    print(f"nanofn: no MODEL given, so using the built-in demo model {path}.\n"
          f"  It has RANDOM weights: its text is gibberish by design. It shows the whole pipeline\n"
          f"  running (tokenizer, scheduler, paged KV cache, model, sampler, detokenizer).\n"
          f"  To run a real checkpoint, pass its local Hugging Face folder:\n"
          f"  nanofn generate /path/to/Qwen3-0.6B --prompt '...'", file=sys.stderr)
    return path


# --- worker (a host of tensor-parallel ranks) ------------------------------------------------

CLUSTER_FLAGS = ("tensor_parallel_size", "nnodes", "node_rank", "master_addr", "master_port")


def _add_worker(commands: Any) -> None:
    p = commands.add_parser(
        "worker", help="run this host's tensor-parallel ranks for an engine on another host",
        description="Tensor parallelism across hosts: start this host's share of the ranks "
                    "(--tensor-parallel-size / --nnodes of them) and serve the engine that "
                    "node 0 runs (nanofn serve, generate or bench with the same --nnodes, "
                    "--master-addr and --master-port, and --node-rank 0). The model folder "
                    "must be at the same path on every host. Exits when the engine closes.",
        epilog="example: nanofn worker --tensor-parallel-size 2 --nnodes 2 --node-rank 1 "
               "--master-addr 10.0.0.1 --master-port 29500")
    add_flags(p, "cluster", {name: ENGINE_FLAGS[name] for name in CLUSTER_FLAGS}, EngineOptions)
    p.set_defaults(run=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    """This host's ranks, until the engine closes (``remote_ranks.run_node``)."""
    from nanofn.runner.remote_ranks import run_node

    with _user_errors():
        options = EngineOptions(model="", **{name: getattr(args, name) for name in CLUSTER_FLAGS
                                             if getattr(args, name) is not None})
        if options.node_rank == 0:
            raise ValueError("node_rank 0 runs the engine: use nanofn serve, generate or bench "
                             "there; give a worker host its --node-rank (1 to nnodes - 1)")
        return run_node(options.tensor_parallel_size, options.nnodes, options.node_rank,
                        options.master_addr, options.master_port)


def _worker_host(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``run``, except on a worker host (``--node-rank`` above 0): there ``run_worker``."""
    def run_or_work(args: argparse.Namespace) -> int:
        if (args.node_rank or 0) > 0:
            return run_worker(args)
        return run(args)
    return run_or_work


# --- generate -------------------------------------------------------------------------------

def _add_generate(commands: Any) -> None:
    p = commands.add_parser(
        "generate", help="complete prompts with a model",
        description="Complete each prompt with a local Hugging Face model and print the "
                    "outputs. Without MODEL, a tiny built-in random-weight model is used.",
        epilog="example: nanofn generate /models/Qwen3-0.6B --chat --prompt 'Hello!' "
               "--max-tokens 64 --temperature 0.6")
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="a local Hugging Face model folder (default: the built-in demo model)")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a prompt (repeatable; default: a couple of examples)")
    p.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through the chat template")
    add_flags(p, "sampling", SAMPLING_FLAGS, SamplingParams)
    add_flags(p, "engine options", ENGINE_FLAGS, EngineOptions)
    p.set_defaults(run=_worker_host(run_generate))


def _add_serve(commands: Any) -> None:
    p = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a local Hugging Face model over the OpenAI API (/v1/completions, "
                    "/v1/chat/completions, /v1/models), with /health, /version, /tokenize, "
                    "/detokenize and Prometheus /metrics. Without MODEL, the built-in demo "
                    "model.",
        epilog="example: nanofn serve /models/Qwen3-0.6B --port 8000 --api-key secret")
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="a local Hugging Face model folder (default: the built-in demo model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ requests")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in the API (default: MODEL as given)")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="N engine replicas, each in a process of its own on its own GPUs "
                        "(--tensor-parallel-size of them), behind this endpoint; requests "
                        "sharing a first block of prompt tokens go to the same replica "
                        "(default: %(default)s)")
    p.add_argument("--api-server-count", type=int, metavar="N",
                   help="N HTTP processes on the one port, each a client of every engine "
                        "(the HTTP side's Python is then spread over N cores; vLLM's flag) "
                        "(default: --data-parallel-size)")
    _add_chat_flags(p.add_argument_group("chat completions (vLLM's flags)"))
    add_flags(p, "server limits", SERVER_FLAGS, ServerLimits)
    add_flags(p, "engine options", ENGINE_FLAGS, EngineOptions)
    p.set_defaults(run=_worker_host(run_serve))


def _add_chat_flags(group: Any) -> None:
    from nanofn.server.reasoning import REASONING_PARSERS
    from nanofn.server.tool_parsers import TOOL_PARSERS

    group.add_argument("--chat-template", metavar="TEMPLATE",
                       help="a Jinja chat template (a file, or the template itself) for chat "
                            "completions and /tokenize, instead of the tokenizer's")
    group.add_argument("--default-chat-template-kwargs", metavar="JSON", type=_json_object,
                       default={}, help="template arguments for every chat request, under its "
                                        "own chat_template_kwargs, e.g. "
                                        "'{\"enable_thinking\": false}'")
    group.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS),
                       help="move the thinking block out of the content into "
                            "reasoning_content (and reasoning)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='read the tool calls the model chooses to make (tool_choice="auto",'
                            " the default with tools); needs --tool-call-parser")
    group.add_argument("--tool-call-parser", choices=list(TOOL_PARSERS),
                       help="the model's tool-call format: hermes (Qwen3), qwen3_xml or "
                            "qwen3_coder (Qwen3-Coder, Qwen3.5)")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def run_serve(args: argparse.Namespace) -> int:
    from nanofn.server.api_servers import HttpOptions, run_http_server, serve_in_processes
    from nanofn.server.chat_output import ChatOptions, load_chat_template

    if args.data_parallel_size < 1:
        raise UsageError(f"--data-parallel-size must be positive, got {args.data_parallel_size}")
    api_server_count = (args.data_parallel_size if args.api_server_count is None
                        else args.api_server_count)
    if api_server_count < 1:
        raise UsageError(f"--api-server-count must be positive, got {args.api_server_count}")
    with _user_errors():  # before the model loads
        limits = ServerLimits(**given(args, SERVER_FLAGS))
        chat_options = ChatOptions(
            chat_template=args.chat_template and load_chat_template(args.chat_template),
            default_chat_template_kwargs=args.default_chat_template_kwargs,
            reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice)
    model = args.model or str(announced_demo_model())
    http = HttpOptions(args.served_model_name or args.model or DEMO_MODEL, args.api_key,
                       chat_options, limits, args.host, args.port)
    if api_server_count > 1:
        with _user_errors():
            return serve_in_processes(model, engine_kwargs(args), args.data_parallel_size,
                                      api_server_count, http)
    with _user_errors():
        llm = _serving_engine(model, args)
    try:
        run_http_server(llm, http)
    finally:
        llm.close()
    return 0


def _serving_engine(model: str, args: argparse.Namespace) -> Any:
    """The server's engine: one ``AsyncLLM``, or ``--data-parallel-size`` of them."""
    from nanofn.server.async_engine import AsyncLLM
    from nanofn.server.data_parallel import DataParallelLLM

    if args.data_parallel_size == 1:
        return AsyncLLM(model, **engine_kwargs(args))
    return DataParallelLLM.start(model, args.data_parallel_size, **engine_kwargs(args))


def run_generate(args: argparse.Namespace) -> int:
    sampling_params(args)  # a bad flag is reported before the model loads
    llm = load_llm(args.model or announced_demo_model(), args)
    prompts = args.prompt or DEFAULT_PROMPTS
    with llm, _user_errors():
        # what the flags leave unset comes from the model's generation config, as in vLLM
        params = replace(llm.get_default_sampling_params(), **given(args, SAMPLING_FLAGS))
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                               use_tqdm=False)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
    for index, (prompt, output) in enumerate(zip(prompts, outputs)):
        print(f"Prompt {index}: {prompt!r}")
        for completion in output.outputs:
            label = "Output" if len(output.outputs) == 1 else f"Output {completion.index}"
            details = f"finish: {completion.finish_reason}, {len(completion.token_ids)} tokens"
            if completion.cumulative_logprob is not None:
                details += f", logprob {completion.cumulative_logprob:.2f}"
            print(f"  {label}: {completion.text!r} ({details})")
    if args.trace:
        print(f"nanofn: trace written to {args.trace}; inspect it with: nanofn replay "
              f"{args.trace}", file=sys.stderr)
    return 0


# --- bench ----------------------------------------------------------------------------------

def _add_bench(commands: Any) -> None:
    from nanofn.model.tiny import PRESETS

    p = commands.add_parser(
        "bench", help="measure offline throughput on the standard workload",
        description="Time nano-vllm's offline-throughput workload (seed 0: random token-id "
                    "prompts of U(100, 1024) tokens, U(100, 1024) output tokens each, "
                    "ignore_eos, temperature 0.6) after a warm-up, and compare it with the "
                    "physical floor of the model's shape on the workload, where the device's "
                    "rates are known (an H100) or given (--bw and --tflops). On a CPU the "
                    "default workload is smaller (64 requests, prompts of U(100, 256) tokens, "
                    "U(100, 128) output tokens). Prints the workload, the tokens, the elapsed "
                    "time, output tok/s, the fraction of the floor reached and the engine's "
                    "figures. Without MODEL or --random-weights, the built-in demo model.",
        epilog="example: nanofn bench --random-weights qwen3-0.6b --json result.json")
    model = p.add_mutually_exclusive_group()
    model.add_argument("model", nargs="?", metavar="MODEL",
                       help="a local Hugging Face model folder (default: the built-in demo "
                            "model)")
    model.add_argument("--random-weights", choices=list(PRESETS), metavar="PRESET",
                       help=f"random weights in this shape, made on the device from a config "
                            f"(--load-format dummy) that is written once into the cache folder "
                            f"(choices: {', '.join(PRESETS)})")
    for name, meaning in (("num_seqs", "number of requests"),
                          ("max_input_len", "prompt lengths are U(100, N), or U(1, N) below 100"),
                          ("max_output_len", "output lengths are U(100, N), or U(1, N) below 100")):
        p.add_argument("--" + name.replace("_", "-"), type=int, metavar="N",
                       help=f"{meaning} (default: {STANDARD_SIZES[name]}; {CPU_SIZES[name]} on "
                            f"a CPU)")
    p.add_argument("--workload", choices=["standard", "shared-prefix"], default="standard",
                   help=f"standard (above), or shared-prefix: {describe_sizes(SHARED_PREFIX_SIZES)}"
                        f" ({describe_sizes(CPU_SHARED_PREFIX_SIZES)} on a CPU; --num-seqs "
                        f"applies); default: %(default)s")
    p.add_argument("--bw", type=float, metavar="GBPS",
                   help=f"memory bandwidth for the floor, GB/s (default: the device's where "
                        f"known: {_known_rates(0)}; elsewhere no floor is shown)")
    p.add_argument("--tflops", type=float, metavar="T",
                   help=f"matmul rate for the floor, TFLOP/s (default: the device's where "
                        f"known: {_known_rates(1)})")
    p.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    p.add_argument("--profile", action="store_true",
                   help="also measure the GPU's busy time (CUDA events around each step; rank "
                        "0's with tensor parallelism) and print the share of the run it sat "
                        "idle, waiting for the host")
    add_flags(p, "engine options", ENGINE_FLAGS, EngineOptions)
    p.set_defaults(run=_worker_host(run_bench))


def _workload_sizes(args: argparse.Namespace, device: str) -> dict[str, int]:
    """The workload's sizes: those given, the others the device's defaults (smaller on a CPU)."""
    cpu = device == "cpu"
    if args.workload == "shared-prefix":
        defaults = CPU_SHARED_PREFIX_SIZES if cpu else SHARED_PREFIX_SIZES
    else:
        defaults = CPU_SIZES if cpu else STANDARD_SIZES
    return {name: default if getattr(args, name, None) is None else getattr(args, name)
            for name, default in defaults.items()}


def _workload(sizes: dict[str, int], vocab_size: int) -> Workload:
    if "shared_len" in sizes:
        return shared_prefix_workload(**sizes, vocab_size=vocab_size)
    return standard_workload(**sizes, vocab_size=vocab_size)


def _known_rates(index: int) -> str:
    return ", ".join(f"{rates[index]:g} on an {name}" for name, rates in KNOWN_DEVICE_RATES.items())


def run_bench(args: argparse.Namespace) -> int:
    for flag in ("num_seqs", "max_input_len", "max_output_len", "bw", "tflops"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    device = _device_name(args.device or "auto")
    if args.profile and device == "cpu":
        raise UsageError("--profile measures a GPU's busy time: it needs a CUDA device")
    model = (args.model or (random_weights_model(args.random_weights) if args.random_weights
                            else announced_demo_model()))
    if args.random_weights and args.load_format is None:
        args.load_format = "dummy"
    llm = load_llm(model, args)
    engine = llm.engine
    sizes = _workload_sizes(args, device)
    workload = _workload(sizes, engine.text_config.vocab_size)
    timeline = engine.runner.new_timeline() if args.profile else None  # (rank 0's, with TP)
    dtype = engine.runner.dtype
    data_types = bench_data_types(engine.hf_config, engine.options, dtype)
    print(f"workload: {describe_sizes(sizes)}"
          + (" (the CPU default)" if sizes in (CPU_SIZES, CPU_SHARED_PREFIX_SIZES) else ""),
          flush=True)
    with llm, _user_errors():
        result = measure(llm, workload, timeline)
    dims = ModelDims.from_config(engine.hf_config.to_dict())
    rates = device_rates(device, args.bw, args.tflops)
    best = None
    if rates is not None:  # with tensor parallelism, every GPU's bandwidth and matmuls together
        rates = tuple(rate * engine.options.tensor_parallel_size for rate in rates)
        best = floor(dims, [len(p) for p in workload.prompts], workload.max_tokens,
                     bandwidth_gbps=rates[0], tflops=rates[1], bytes_per_param=dtype.itemsize,
                     shared_prefix_len=sizes.get("shared_len", 0),
                     **data_types["floor_bytes"])
    config = engine.scheduler_config
    num_blocks = engine.state.pool.num_blocks
    setup = {"model": str(model), "device": device, "dtype": str(dtype).removeprefix("torch."),
             "tensor_parallel_size": engine.options.tensor_parallel_size}
    parallel = (f" x {setup['tensor_parallel_size']}" if setup["tensor_parallel_size"] > 1
                else "")
    active = (f" ({dims.active_params / 1e6:.3g}M active)"
              if dims.active_params != dims.num_params else "")
    print(f"model: {model} ({dims.num_layers} layers, {dims.num_params / 1e6:.3g}M parameters"
          f"{active}, {setup['dtype']} on {setup['device']}{parallel})")
    print(f"data types: {data_types['description']}")
    print(f"requests {result.num_requests}, prompt tokens {result.num_prompt_tokens:,}, "
          f"output tokens {result.num_output_tokens:,}")
    print(f"elapsed {format_seconds(result.elapsed_s)}  ->  {result.output_tok_s:,.0f} output "
          f"tok/s")
    if best is None:
        print(f"no floor: the rates of this device ({device}) are not known; give both --bw "
              f"and --tflops to compare with one")
    else:
        print(f"floor: {best.describe()} (at {rates[0]:g} GB/s, {rates[1]:g} TFLOP/s"
              f"{parallel}); this run: {_percent(best.seconds / result.elapsed_s)} of the floor")
    if result.device_busy_s is not None:
        print(f"device busy {format_seconds(result.device_busy_s)}: GPU idle "
              f"{result.device_idle_fraction:.1%} of the run, wall / device-busy "
              f"{result.elapsed_s / result.device_busy_s:.3f}")
        for label, (steps, busy, idle) in sorted(timeline.by_label().items()):
            print(f"  {label}: {steps} steps, device {busy:.3f} s, idle before them "
                  f"{idle:.3f} s" if steps else f"  {label}: idle {idle:.3f} s")
    print(f"kernels compiled during the run: {_describe_compiled(result)}")
    print(f"engine: preemptions {result.num_preemptions}, prefix cache hit rate "
          f"{result.prefix_cache_hit_rate:.1%}, KV blocks {num_blocks:,} of "
          f"{config.block_size} tokens")
    if args.json:
        report = {
            **setup, "workload": sizes, "engine_options": engine_kwargs(args),
            **asdict(result), "output_tok_s": result.output_tok_s,
            "device_idle_fraction": result.device_idle_fraction,
            "num_kv_blocks": num_blocks, "block_size": config.block_size,
            "data_types": {k: v for k, v in data_types.items() if k != "floor_bytes"},
        }
        if best is not None:
            report.update({
                "floor_prefill_s": best.prefill_s, "floor_decode_s": best.decode_s,
                "floor_s": best.seconds, "floor_output_tok_s": best.output_tok_s,
                "fraction_of_floor": best.seconds / result.elapsed_s, "bw_gbps": rates[0],
                "tflops": rates[1]})
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _describe_compiled(result: Any) -> str:
    """The Triton kernels compiled inside a measured run, in a few words."""
    if result.kernels_compiled is None:
        return "not counted (each tensor-parallel rank compiles in its own process)"
    count = sum(result.kernels_compiled.values())
    if count == 0:
        return "none"
    names = ", ".join(f"{name} x{n}" for name, n in sorted(result.kernels_compiled.items()))
    return f"{count} in {result.compile_s:.2f} s ({names})"


def _device_name(device: str) -> str:
    """The name of the GPU that the ``device`` option picks (as in "NVIDIA H100 80GB HBM3"),
    or "cpu"."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(None if device == "auto" else device)


def _percent(x: float) -> str:
    return f"{x:.1%}" if x >= 0.01 else f"{100 * x:.2g}%"


# --- replay ---------------------------------------------------------------------------------

REPLAY_NOTATION = (
    "Each step line lists the scheduled sequences as ID@START+COUNT: the sequence computes "
    "COUNT positions from START on (a prompt chunk, or one token when decoding), with * when "
    "it samples the next token. A request with n > 1 runs as n sequences with ids "
    "REQUEST:INDEX, so 0:1@12+1* is the second sample of request 0 decoding position 12.")


def _add_replay(commands: Any) -> None:
    p = commands.add_parser(
        "replay", help="replay a recorded trace without a model",
        description="Rebuild every scheduler state and plan of a run recorded with "
                    "LLM(..., trace=PATH) or --trace PATH. Lists one line per step: the "
                    "scheduled sequences, the preempted and the finished ones. "
                    + REPLAY_NOTATION,
        epilog="example: nanofn replay run.jsonl --check --plot run.png")
    p.add_argument("trace", metavar="TRACE", help="a trace file (JSON lines)")
    p.add_argument("--step", type=int, metavar="N",
                   help="show the whole state after step N: sequences, block pool, figures "
                        "and the plan")
    p.add_argument("--check", action="store_true",
                   help="verify every replayed plan against the trace's digests, up to step "
                        "N with --step (exit 1 on the first difference)")
    p.add_argument("--plot", metavar="PNG",
                   help="draw the run step by step into PNG (or .svg, .pdf): sequences running "
                        "and waiting, KV blocks, tokens scheduled, preemptions and prefix-cache "
                        "hits (needs the plot extra: pip install 'nanofn[plot]')")
    p.set_defaults(run=run_replay)


def _add_diff(commands: Any) -> None:
    p = commands.add_parser(
        "diff", help="compare two traces: the first step where they differ",
        description="Replay two traces side by side and report their differing settings and "
                    "the first step whose plans or delivered tokens differ: which sequences "
                    "were scheduled differently (positions, blocks, tokens), which were "
                    "preempted, and both states right after that step. Exit code 0 when the "
                    "traces are identical, 1 when they differ, 2 when one cannot be read.",
        epilog="example: nanofn diff run-a.jsonl run-b.jsonl")
    p.add_argument("trace_a", metavar="A", help="a trace file (JSON lines)")
    p.add_argument("trace_b", metavar="B", help="another trace file")
    p.set_defaults(run=run_diff)


def read_trace_file(path: str) -> Trace:
    """The trace at ``path``; a missing, unreadable or malformed file is a ``UsageError``."""
    try:
        return read_trace(path)
    except (OSError, TraceError) as e:
        raise UsageError(f"cannot read trace {path}: {e}") from e


def run_replay(args: argparse.Namespace) -> int:
    trace = read_trace_file(args.trace)
    steps = [t.step for t in trace.steps]
    if args.step is not None and args.step not in steps:
        bounds = f"steps {steps[0]} to {steps[-1]}" if steps else "no steps"
        raise UsageError(f"step {args.step} is not in the trace (it has {bounds})")
    try:
        if args.plot:
            _plot(trace, args)
        if args.step is not None:
            state, plan = next((s, p) for s, p in replay(trace, check=args.check)
                               if p.step == args.step)
            _print_state(state, plan, len(steps))
            if args.check:
                print(f"trace OK up to step {args.step}")
        elif args.check and not args.plot:
            count = sum(1 for _ in replay(trace, check=True))
            print(f"trace OK: {count} steps")
        elif not args.plot:
            c = trace.config
            print(f"trace {args.trace}: {len(steps)} steps, {trace.num_blocks} KV blocks of "
                  f"{c.block_size} tokens, model {trace.meta.get('model', '?')}")
            for state, plan in replay(trace):
                print(_step_line(state, plan))
    except ValueError as e:  # a TraceError, or step() refusing the events: a broken trace
        print(f"nanofn replay: {e}", file=sys.stderr)
        return 1
    return 0


def _plot(trace: Trace, args: argparse.Namespace) -> None:
    """Draw the replayed run into ``args.plot`` (checking it on the way with ``--check``)."""
    try:
        from nanofn.cli.plot import FORMATS, plot_run
    except ImportError as e:
        raise UsageError(f"--plot needs matplotlib ({e}): pip install 'nanofn[plot]'") from e
    if Path(args.plot).suffix.lower().lstrip(".") not in FORMATS:
        raise UsageError(f"--plot {args.plot}: the file's suffix chooses the format, one of "
                         f"{', '.join('.' + f for f in FORMATS)}")
    if not trace.steps:
        raise UsageError(f"--plot: trace {args.trace} has no steps to draw")
    series = run_series(replay(trace, check=args.check))
    model = Path(trace.meta.get("model", "?")).name
    try:
        plot_run(series, args.plot, f"{Path(args.trace).name} (model {model})")
    except OSError as e:
        raise UsageError(f"cannot write {args.plot}: {e}") from e
    print(f"wrote {args.plot}: {len(series.steps)} steps" + (", trace OK" if args.check else ""))


def run_diff(args: argparse.Namespace) -> int:
    from nanofn.cli.diff import describe_diff

    a, b = read_trace_file(args.trace_a), read_trace_file(args.trace_b)
    try:
        diff = diff_traces(a, b)
    except TraceError as e:
        raise UsageError(f"cannot replay {e} (A: {args.trace_a}, B: {args.trace_b})") from e
    print(f"A: {args.trace_a}\nB: {args.trace_b}")
    print("\n".join(describe_diff(diff, len(a.steps))))
    return 0 if diff.identical else 1


def _step_line(state: EngineState, plan: BatchPlan) -> str:
    entries = plan.entries()
    parts = [f"step {plan.step}: {len(entries)} seqs, prefill {plan.num_prefill_tokens}, "
             f"decode {plan.num_decode_tokens}"]
    if entries:
        parts.append(" ".join(_scheduled(s) for s in entries))
    if state.preempted:
        parts.append("preempted " + " ".join(state.preempted))
    if state.finished:
        parts.append("finished " + " ".join(seq.seq_id for seq in state.finished))
    if plan.state_restores or plan.state_saves:
        parts.append(_state_copies(plan))
    return " | ".join(parts)


def _state_copies(plan: BatchPlan) -> str:
    """A hybrid plan's recurrent-state copies: ``restore SAVED->WORKING`` before the step,
    ``save ID@TOKENS->SLOT`` after it."""
    restores = [f"restore {src}->{dst}" for src, dst in plan.state_restores]
    ends = plan.start_pos + plan.num_scheduled
    saves = [f"save {plan.seq_ids[i]}@{ends[i]}->{slot}" for i, slot in plan.state_saves]
    return " ".join(restores + saves)


def _scheduled(s: ScheduledSeq) -> str:
    """``id@start+count``, with ``*`` when the chunk samples the next token."""
    return f"{s.seq_id}@{s.start_pos}+{s.num_tokens}{'*' if s.sample else ''}"


def _print_state(state: EngineState, plan: BatchPlan, num_steps: int) -> None:
    print(f"state after step {state.step} of {num_steps}")
    print(f"sequences ({len(state.running)} running, {len(state.waiting)} waiting, "
          f"{len(state.finished)} finished at this step):")
    for seq in (*state.running, *state.waiting, *state.finished):
        print(_describe_seq(seq))
    pool = state.pool
    owned = [f"{block}:{count}" for block, count in enumerate(pool.ref_counts) if count]
    print(f"block pool: {pool.num_blocks} blocks, {pool.num_used} owned, "
          f"{pool.num_plain_free} plain free, {pool.num_cached_free} cached free, "
          f"{len(pool.by_hash)} in the prefix cache")
    print(f"  cached free, first evicted first: {_short(list(pool.cached_free()))}")
    print(f"  reference counts of owned blocks (block:count): {_short(owned)}")
    if state.states is not None:
        _print_state_slots(state)
    f = figures(state)
    print(f"figures: KV usage {f.kv_cache_usage:.1%} ({f.kv_blocks_used} of {f.kv_blocks_total} "
          f"blocks), prefix cache hit rate {f.prefix_cache_hit_rate:.1%}, preemptions "
          f"{f.num_preemptions}, finished so far {f.num_finished}")
    entries = plan.entries()
    print(f"plan of step {plan.step}: {len(entries)} seqs, prefill {plan.num_prefill_tokens} "
          f"tokens, decode {plan.num_decode_tokens} tokens")
    tables = {seq.seq_id: seq.block_table for seq in state.running}
    for s in entries:
        tokens = ["pending" if t == PENDING_TOKEN else t for t in s.token_ids]
        print(f"  {_scheduled(s)} tokens {_short(tokens)} blocks {_short(tables[s.seq_id])}")
    if plan.state_restores or plan.state_saves:
        print(f"  recurrent states: {_state_copies(plan)}")


def _print_state_slots(state: EngineState) -> None:
    states = state.states
    working = {seq.seq_id: seq.state_slot for seq in state.running}
    print(f"state slots: {states.num_slots} slots, {states.num_working} working, "
          f"{states.num_saved} saved, {states.num_free} free")
    print(f"  working (sequence:slot): {_short([f'{i}:{s}' for i, s in working.items()])}")
    print("  saved (slot:tokens), first evicted first: "
          + _short([f"{entry.slot}:{entry.num_tokens}" for _, entry in states.saved_by_age()]))


def _describe_seq(seq: Seq) -> str:
    status = seq.status.value
    if seq.finish_reason is not None:
        status += f" ({seq.finish_reason.value})"
    pending = f" + {seq.num_pending} pending" if seq.num_pending else ""
    return (f"  {seq.seq_id}: {status}, {seq.num_tokens} tokens ({seq.num_prompt_tokens} prompt "
            f"+ {seq.num_output_tokens} output){pending}, arrived at step "
            f"{seq.spec.arrival_step}, computed {seq.num_computed}, cached at "
            f"admission {seq.num_cached_tokens}, preemptions {seq.num_preemptions}"
            f"{f', state slot {seq.state_slot}' if seq.state_slot >= 0 else ''}\n"
            f"      blocks {_short(seq.block_table)}\n"
            f"      tokens {_short(seq.token_ids)}")


def _short(items: Sequence[Any]) -> str:
    """``[a, b, c]``, or its ends around ``... (N more) ...`` when long."""
    items = list(items)
    if len(items) <= SHOWN_ITEMS:
        return "[" + ", ".join(map(str, items)) + "]"
    head, tail = items[:SHOWN_ITEMS - 4], items[-4:]
    hidden = len(items) - len(head) - len(tail)
    return ("[" + ", ".join(map(str, head)) + f", ... ({hidden} more) ..., "
            + ", ".join(map(str, tail)) + "]")


if __name__ == "__main__":
    sys.exit(main())
