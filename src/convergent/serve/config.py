"""Config of LLM serving (``serve`` section). Defaults work on a 2-core laptop.

``serve`` holds the checkpoint (``model``) and one typed sub-section per concern, each
handed whole to the code that reads it: ``engine`` (how the model runs: dtype, INT8, device,
KV cache; the stages' :class:`~convergent.serve.stage.StageSpec`), ``scheduler`` (the
policy, its pipeline stages and budgets; the schedulers of
:mod:`convergent.serve.scheduler`), ``http`` (the API: address, key, request limits),
``faults`` (stage failures and restarts) and ``dispatch`` (many instances behind one
dispatcher). :data:`MOVED_KEYS` maps every key of the earlier flat layout to its place.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from convergent.core.configbase import Count, Count0, Port, Section

__all__ = [
    "MOVED_KEYS",
    "DispatchConfig",
    "EngineConfig",
    "FaultsConfig",
    "HttpConfig",
    "SchedulerConfig",
    "ServeConfig",
]


class EngineConfig(Section):
    """``serve.engine``: how the model runs. ``kv_budget_bytes`` is the KV cache of the
    whole pipeline (summed over stages; each stage holds the K/V of its own layers); 0
    (the default) sizes it: 256 MiB on the CPU, and on CUDA from the GPU's free memory
    after the weights times ``gpu_memory_utilization``, less the activation reserve (as
    vLLM's ``gpu_memory_utilization``; :mod:`convergent.serve.memory`), which on CUDA also
    bounds ``serve.scheduler.max_num_seqs``."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights, KV, attention
    # int8: weight-only per-channel INT8; int8-dynamic: torch dynamic INT8 (CPU, fp32); see convergent.compress
    quantize: Literal["none", "int8", "int8-dynamic"] = "none"
    device: Literal["cpu", "cuda"] = "cpu"  # cuda: one GPU per stage, NCCL between stages
    torch_threads: Count = 1  # per stage process
    kv_budget_bytes: Count0 = 0  # bytes of K+V over all stages; 0: auto (see above)
    # CUDA, kv_budget_bytes 0: the share of each stage GPU's free memory (after its
    # weights) that the KV cache and the step's activations may take
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, allow_inf_nan=False)
    block_size: Count = 16  # tokens per KV block
    max_model_len: Count = 2048  # prompt + output tokens per request
    # decode attention: auto = triton on CUDA where Triton imports, else sdpa_gather (the
    # padded gather + SDPA); flex = FlexAttention (compiled on CUDA); prefills take SDPA
    attention_backend: Literal["auto", "sdpa_gather", "triton", "flex"] = "auto"
    # decode steps through static buffers padded to batch-size buckets, captured as CUDA
    # graphs at start-up (convergent.models.paged_graphs): auto = on for CUDA with the
    # triton or sdpa_gather backend; on = also on the CPU, there the padded static path
    # runs without capture (a check of it); off = eager
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    cuda_graph_max_seqs: Count0 = 0  # largest captured bucket; 0: serve.scheduler.max_num_seqs
    # the other steps (prefills, chunks, decodes together) with cuda_graphs on/auto: each
    # layer's dense work as CUDA graphs per token bucket up to serve.scheduler.
    # max_batched_tokens, the attention eager between them (convergent.models.paged_pieces)
    mixed_graphs: Literal["auto", "off"] = "auto"
    # decode: a CPU float32 stage runs its pure decode steps as one torch.compile graph
    # (Inductor, weights frozen; convergent.models.paged_compiled), compiled at start-up
    # (~30 s on 2 cores the first time, then from Inductor's cache); off: eager
    compile: Literal["off", "decode"] = "off"
    # host work overlapped with the device step (convergent.serve.engine_async): auto = on
    # for CUDA; the tokens are the same either way
    async_scheduling: Literal["auto", "on", "off"] = "auto"

    @model_validator(mode="after")
    def _compile_on_cpu_float32(self) -> EngineConfig:
        if self.compile == "decode" and (self.device, self.dtype, self.quantize) != (
                "cpu", "float32", "none"):
            raise ValueError("compile=decode is the CPU float32 path (device cpu, dtype "
                             "float32, quantize none); CUDA decodes take cuda_graphs")
        return self


class SchedulerConfig(Section):
    """``serve.scheduler``: which tokens go into each micro-batch (see
    :mod:`convergent.serve.scheduler`), over how many pipeline stages."""

    kind: Literal["sequential", "interleaved", "tdpipe"] = "tdpipe"
    stages: Count = 2  # pipeline stages (processes); sequential always uses one process
    predictor: Literal["learned", "oracle", "constant"] = "learned"  # tdpipe's output lengths
    predictor_path: str = ""  # a trained predictor (.json); empty: train on a trace at start
    max_num_seqs: Count = 256  # sequences per micro-batch (decode)
    max_batched_tokens: Count = 1024  # token budget of a micro-batch (prefill)
    chunked_prefill: bool = False  # interleaved only: split prompts to fit the budget
    profile_costs: bool = True  # tdpipe: profile the stage cost table in situ at start-up
    # tdpipe: predicted peak KV use (whole blocks) allowed by prefill; a mispredicted
    # request that outgrows it is preempted by recompute
    tdpipe_memory_fraction: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    work_stealing: bool = True  # tdpipe: balance decode micro-batches
    # tdpipe: a request queued this long forces a prefill phase (when the KV cache can take
    # it), bounding its wait for a first token while others decode
    tdpipe_max_wait_s: float = Field(1.0, gt=0, le=3600.0, allow_inf_nan=False)


class HttpConfig(Section):
    """``serve.http``: the OpenAI-compatible API of an instance (or the dispatcher)."""

    host: str = Field("127.0.0.1", min_length=1)
    port: Port = 8000
    api_key: str = ""  # empty: no authentication
    default_max_tokens: Count = 128  # requests without max_tokens
    request_timeout_s: float = Field(600.0, gt=0.0, le=86400.0, allow_inf_nan=False)  # then 504
    # SIGTERM: finish what runs for this long, then cancel
    shutdown_timeout_s: float = Field(10.0, ge=0.0, le=3600.0, allow_inf_nan=False)
    # a larger request body is refused (413) before it is parsed or tokenized
    max_request_bytes: int = Field(8 * 2**20, ge=1024, le=2**31)


class FaultsConfig(Section):
    """``serve.faults``: stage failures (see :mod:`convergent.serve.engine_faults`); the
    dispatcher restarts its instances by the same budget."""

    restart_on_failure: bool = True  # a dead stage: end its requests with an error, restart
    max_restarts: int = Field(3, ge=0, le=100)  # restarts within 10 minutes before giving up
    heartbeat_timeout_s: float = Field(30.0, gt=0.5, le=3600.0, allow_inf_nan=False)  # silent = dead


class DispatchConfig(Section):
    """``serve.dispatch``: many instances behind one dispatcher (`convergent serve
    --instances N`, :mod:`convergent.serve.dispatch`)."""

    instances: int = Field(1, ge=1, le=64)
    policy: Literal["load", "round_robin"] = "load"
    max_outstanding: int = Field(64, ge=1, le=100000)  # per instance; the rest queue
    pin_cpus: bool = True  # instance i runs on core i mod cores (Linux)
    # instances started elsewhere (e.g. one per cluster node): the dispatcher routes to these
    # URLs instead of starting its own; their restarts are their own (or the batch system's)
    instance_urls: list[Annotated[str, Field(pattern=r"^https?://[^/\s]+/?$")]] = Field(
        default_factory=list, max_length=64
    )


class ServeConfig(Section):
    """Pipeline-parallel serving settings.

    ``model`` is a Hugging Face Llama checkpoint directory (config.json + safetensors);
    empty means "create a tiny random Llama under ``<run dir>/serve-model``" so the
    commands work out of the box.
    """

    model: str = ""
    engine: EngineConfig = EngineConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    http: HttpConfig = HttpConfig()
    faults: FaultsConfig = FaultsConfig()
    dispatch: DispatchConfig = DispatchConfig()


def _moved(section: str, keys: str) -> dict[str, str]:
    return {f"serve.{k}": f"serve.{section}.{k}" for k in keys.split()}


# Keys of the flat layout (before the sub-sections) and where each went; ``serve.scheduler``
# was the policy's name and is now a section (its ``kind``).
MOVED_KEYS: dict[str, str] = {
    **_moved("engine", "dtype quantize device torch_threads kv_budget_bytes block_size max_model_len"),
    # newer than the flat layout; their flat spelling is refused the same way, naming the place
    **_moved("engine", "gpu_memory_utilization attention_backend cuda_graphs "
             "cuda_graph_max_seqs mixed_graphs async_scheduling compile"),
    **_moved(
        "scheduler",
        "stages predictor predictor_path max_num_seqs max_batched_tokens chunked_prefill "
        "profile_costs tdpipe_memory_fraction work_stealing tdpipe_max_wait_s",
    ),
    **_moved(
        "http",
        "host port api_key default_max_tokens request_timeout_s shutdown_timeout_s "
        "max_request_bytes",
    ),
    **_moved("faults", "restart_on_failure max_restarts heartbeat_timeout_s"),
    **_moved("dispatch", "instances pin_cpus instance_urls"),
    "serve.scheduler": "serve.scheduler.kind",
    "serve.dispatch_policy": "serve.dispatch.policy",
    "serve.dispatch_max_outstanding": "serve.dispatch.max_outstanding",
}
