"""Data parallelism: several engines, each in a process of its own on its own GPUs (or
tensor-parallel group), behind one ``AsyncLLM``-like object that the server uses as it uses one.

Each replica is an ``AsyncLLM``: its engine process, with its own KV cache and prefix cache.
A request goes to the replica that ``routing.choose_replica`` picks (prefix affinity, the least
busy replica when the preferred one is much busier). A replica whose engine stops fails its
own requests, with an error naming it; the others go on serving, and new requests go to them.

GPUs: replica r sees only its own, through ``CUDA_VISIBLE_DEVICES`` set in its engine process
before CUDA starts (``replica_devices``), so the engine inside runs on ``cuda:0`` (and its
tensor-parallel ranks on ``cuda:0..t-1``) as a single engine does.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from nanofn.engine.options import EngineOptions
from nanofn.engine.outputs import RequestOutput
from nanofn.server.async_engine import AsyncLLM, EngineDead, ReplicaView
from nanofn.server.routing import RoutingPolicy, choose_replica
from nanofn.state import Counters, Figures, SamplingParams

REPLICA_VARIABLE = "NANOFN_REPLICA"
T = TypeVar("T")


def replica_devices(replica: int, tensor_parallel_size: int,
                    visible: Sequence[str]) -> list[str]:
    """The GPUs (as ``CUDA_VISIBLE_DEVICES`` entries) of replica ``replica``: the
    ``tensor_parallel_size`` after those of the replicas before it, from the ``visible`` ones."""
    first = replica * tensor_parallel_size
    if first + tensor_parallel_size > len(visible):
        raise ValueError(f"replica {replica} needs GPUs {first} to "
                         f"{first + tensor_parallel_size - 1} of the visible ones, but "
                         f"{len(visible)} are visible ({','.join(visible) or 'none'}): "
                         f"data_parallel_size x tensor_parallel_size must be at most that")
    return list(visible[first:first + tensor_parallel_size])


def replica_environments(data_parallel_size: int, options: EngineOptions,
                         visible: Sequence[str] | None) -> list[dict[str, str]]:
    """The environment of each replica's engine process: its index (``NANOFN_REPLICA``, for
    logs and tools that look for it) and on GPUs (``visible`` not None) its
    ``CUDA_VISIBLE_DEVICES``."""
    named = [{REPLICA_VARIABLE: str(r)} for r in range(data_parallel_size)]
    if visible is None:
        return named
    if options.device.startswith("cuda:"):
        raise ValueError(f"device {options.device!r}: with data_parallel_size > 1 each replica "
                         f"gets its own GPUs (set CUDA_VISIBLE_DEVICES to choose them); give "
                         f"device 'cuda' or 'auto'")
    devices = [replica_devices(r, options.tensor_parallel_size, visible)
               for r in range(data_parallel_size)]
    return [{**n, "CUDA_VISIBLE_DEVICES": ",".join(d)} for n, d in zip(named, devices)]


def visible_gpus(options: EngineOptions) -> list[str] | None:
    """The GPUs the replicas share out (``CUDA_VISIBLE_DEVICES``'s, else every one), or None
    when the engines run on the CPU."""
    import torch

    if options.device == "cpu" or (options.device == "auto" and not torch.cuda.is_available()):
        return None
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


class DataParallelLLM:
    """``AsyncLLM`` replicas behind the ``AsyncLLM`` interface the server uses: ``start``
    starts ``data_parallel_size`` side by side; an HTTP process of ``serve --api-server-count
    N`` puts its attached ones (``AsyncLLM.attach``) together. ``block_size``: the engines'
    (the routing key's length)."""

    def __init__(self, replicas: Sequence[AsyncLLM], block_size: int):
        self.replicas = list(replicas)
        first = self.replicas[0]
        self.tokenizer, self.max_model_len = first.tokenizer, first.max_model_len
        self.generation_defaults = first.generation_defaults
        self.policy = RoutingPolicy(block_size=block_size)
        self.loads = [0] * len(self.replicas)  # requests in flight, on the server's event loop

    @classmethod
    def start(cls, model: str, data_parallel_size: int, **options: Any) -> DataParallelLLM:
        """Start ``data_parallel_size`` replicas, each an engine process on its own GPUs."""
        if not isinstance(data_parallel_size, int) or data_parallel_size < 2:
            raise ValueError(f"data_parallel_size must be an integer of at least 2 here, got "
                             f"{data_parallel_size!r}")
        engine_options, environments = replica_setup(model, data_parallel_size, options)
        replicas = start_all([lambda env=env: AsyncLLM(model, environment=env, **options)
                              for env in environments], AsyncLLM.close)
        return cls(replicas, engine_options.block_size)

    @property
    def failure(self) -> BaseException | None:
        """None while a replica serves; once none does, the first one's failure."""
        failures = [r.failure for r in self.replicas]
        return None if any(f is None for f in failures) else failures[0]

    def views(self) -> list[ReplicaView]:
        return [view for replica in self.replicas for view in replica.views()]

    def figures(self) -> Figures:
        return sum_figures([r.figures() for r in self.replicas], self.counters())

    def counters(self) -> Counters:
        return sum_counters([r.counters() for r in self.replicas])

    async def generate(self, prompt: Any, params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs from the replica the routing policy picks for its prompt (a
        dict with ``prompt_token_ids``, as the server makes them)."""
        live = [r.failure is None for r in self.replicas]
        try:
            replica = choose_replica(_token_ids(prompt), self.loads, live, self.policy)
        except ValueError:
            raise EngineDead(f"every data-parallel replica stopped: {self.failure!r}") from None
        self.loads[replica] += 1
        try:
            async for output in self.replicas[replica].generate(prompt, params, request_id):
                yield output
        except EngineDead as error:
            others = ("the other replicas go on serving" if self.failure is None
                      else "no replica is left")
            raise EngineDead(f"data-parallel replica {replica} of {len(self.replicas)} "
                             f"stopped ({error}); {others}") from error
        finally:
            self.loads[replica] -= 1

    def abort_all(self, error: Callable[[], BaseException]) -> None:
        for replica in self.replicas:
            replica.abort_all(error)

    def close(self) -> None:
        with ThreadPoolExecutor(len(self.replicas)) as pool:  # each waits for its engine
            list(pool.map(AsyncLLM.close, self.replicas))

    @property
    def engine_pids(self) -> list[int]:
        return [r.engine_pid for r in self.replicas]


def _token_ids(prompt: Any) -> Sequence[int]:
    """The token ids that route a prompt: a dict's ``prompt_token_ids`` (the server's
    prompts), or a list of token ids."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"]
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return prompt
    raise TypeError(f"replicas are chosen by a prompt's token ids: give a list of them or "
                    f"{{'prompt_token_ids': [...]}}, not a {type(prompt).__name__}")


def replica_setup(model: str, data_parallel_size: int,
                  options: Mapping[str, Any]) -> tuple[EngineOptions, list[dict[str, str]]]:
    """The engines' options and each replica's environment (``replica_environments``; one
    replica: nothing to set); a ``ValueError`` for a layout data parallelism does not take."""
    engine_options = EngineOptions.from_kwargs(model, **options)
    if data_parallel_size == 1:
        return engine_options, [{}]
    if engine_options.nnodes > 1:
        raise ValueError("data_parallel_size > 1 with nnodes > 1 is not supported: run one "
                         "nanofn serve per tensor-parallel group behind a gateway instead")
    return engine_options, replica_environments(data_parallel_size, engine_options,
                                                visible_gpus(engine_options))


def start_all(starts: list[Callable[[], T]], close: Callable[[T], Any]) -> list[T]:
    """Start every replica at once (each waits for its engine to build); if one fails,
    ``close`` the others and raise its error, naming the replica."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    started = [f.result() for f in futures if f.exception() is None]
    failed = [(i, f.exception()) for i, f in enumerate(futures) if f.exception() is not None]
    if failed:
        for replica in started:
            close(replica)
        index, error = failed[0]
        raise _naming_replica(error, index) from error
    return started


def _naming_replica(error: BaseException, index: int) -> BaseException:
    """``error`` with its message prefixed by the replica it came from, of the same class
    where the class takes one message (a ``ValueError`` stays a user error), else as it is."""
    try:
        return type(error)(f"data-parallel replica {index}: {error}")
    except Exception:
        return error


def sum_figures(figures: Sequence[Figures], counters: Counters) -> Figures:
    """The replicas' figures together: counts summed, the hit rate of their summed
    ``counters``."""
    return Figures(
        step=max(f.step for f in figures),
        num_running=sum(f.num_running for f in figures),
        num_waiting=sum(f.num_waiting for f in figures),
        kv_blocks_used=sum(f.kv_blocks_used for f in figures),
        kv_blocks_total=sum(f.kv_blocks_total for f in figures),
        prefix_cache_hit_rate=(counters.num_cached_tokens / counters.num_admitted_tokens
                               if counters.num_admitted_tokens else 0.0),
        num_preemptions=sum(f.num_preemptions for f in figures),
        num_finished=sum(f.num_finished for f in figures),
        state_slots_total=sum(f.state_slots_total for f in figures),
        state_slots_working=sum(f.state_slots_working for f in figures),
        state_slots_saved=sum(f.state_slots_saved for f in figures))


def sum_counters(counters: Sequence[Counters]) -> Counters:
    return Counters(
        num_preemptions=sum(c.num_preemptions for c in counters),
        num_admitted_tokens=sum(c.num_admitted_tokens for c in counters),
        num_cached_tokens=sum(c.num_cached_tokens for c in counters),
        num_finished=sum(c.num_finished for c in counters))
