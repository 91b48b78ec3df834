"""The serving part's pure pieces: the memory-bandwidth floor of a run and the TD-Pipe
projection onto a PCIe pipeline (issue 39 item 9). No GPU needed: they take a run's
records (``run_trace``'s ``_batch_log`` and ``_step_device_s``) and numbers.

**Floor.** A step must read the weights once (the layers, final norm and LM head: the
embedding is gathered by row, not read) and the K/V of every sequence's context, and write
the K/V of its new tokens. Summed over the run's own steps (their recorded batch shapes)
and divided by the device's measured copy bandwidth (read + write counted, as
``bench/gpu/peaks.py`` measures it), that is the least time the run's schedule could take:
``floor tok/s = output tokens / (sum of step bytes / bandwidth)``. It ignores the prefills'
FLOPs (compute-bound, not bandwidth-bound) and the activations (small next to the weights),
so it is an upper bound on tokens/s for that schedule, not for any schedule.

**Projection.** The run's per-step device seconds (CUDA events) fit one stage's cost
table (:func:`convergent.serve.costs.calibrate_from_run`, the same fit the simulator's
calibration uses), which is split over ``stages`` GPUs by layers (the sampled rows' LM-head
term on the last stage), each later stage paying the PCIe transfer of its input
activations (tokens x hidden x dtype bytes / link bandwidth) and a fixed link latency per
hop; the engine's measured host time per step is charged per micro-batch. Then
bench/serve/sim.py replays the trace through the real ``interleaved`` and ``tdpipe``
schedulers on that table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["BandwidthFloor", "PipelineLink", "bandwidth_floor", "project_pipeline",
           "step_weight_bytes"]


@dataclass(frozen=True)
class BandwidthFloor:
    """The bytes a run's steps must move and the time and tokens/s they allow."""

    steps: int
    weight_bytes: int  # per step
    kv_bytes_per_token: int
    bytes_moved: int  # all steps
    bytes_per_s: float  # measured copy bandwidth
    seconds: float
    output_tokens: int
    tok_s: float
    decode_steps: int
    mean_decode_batch: float
    mean_decode_context: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def step_weight_bytes(mcfg: Any, dtype_bytes: int) -> int:
    """Weight bytes a step reads on one GPU holding the whole model: the layers, final norm
    and LM head (:func:`convergent.serve.memory.stage_weight_bytes` without the embedding)."""
    from convergent.serve.memory import stage_weight_bytes

    # first=False: the embedding is gathered by row; a tied head is still read whole
    return stage_weight_bytes(mcfg, mcfg.num_hidden_layers, False, True, dtype_bytes)


def bandwidth_floor(shapes: list[Any], output_tokens: int, weight_bytes: int,
                    kv_bytes_per_token: int, bytes_per_s: float) -> BandwidthFloor:
    """The floor of a run whose steps had ``shapes`` (:class:`~convergent.serve.costs.
    BatchShape`): per step ``weight_bytes + kv_bytes_per_token x (decode_ctx + tokens)``
    (the contexts' K/V read, the new tokens' K/V written)."""
    moved = sum(weight_bytes + kv_bytes_per_token * (s.decode_ctx + s.tokens) for s in shapes)
    sec = moved / bytes_per_s if bytes_per_s > 0 else float("inf")
    dec = [s for s in shapes if s.decode_seqs]
    n_dec = sum(s.decode_seqs for s in dec)
    return BandwidthFloor(
        steps=len(shapes), weight_bytes=weight_bytes, kv_bytes_per_token=kv_bytes_per_token,
        bytes_moved=moved, bytes_per_s=bytes_per_s, seconds=sec, output_tokens=output_tokens,
        tok_s=output_tokens / sec if sec > 0 else float("inf"), decode_steps=len(dec),
        mean_decode_batch=n_dec / len(dec) if dec else 0.0,
        mean_decode_context=sum(s.decode_ctx for s in dec) / n_dec if n_dec else 0.0)


@dataclass(frozen=True)
class PipelineLink:
    """The projected pipeline: ``stages`` GPUs in a chain over PCIe."""

    stages: int = 4
    link_bytes_per_s: float = 25e9  # PCIe 4.0 x16, ~80% of its 32 GB/s a direction
    link_latency_s: float = 20e-6  # a point-to-point send's launch + PCIe round trip
    activation_dtype_bytes: int = 2  # bf16 activations between stages

    def describe(self, hidden: int) -> dict[str, Any]:
        return {"stages": self.stages, "link": "PCIe 4.0 x16 between neighbouring GPUs, no NVLink",
                "link_bytes_per_s": self.link_bytes_per_s, "link_latency_s": self.link_latency_s,
                "activation_bytes_per_token": hidden * self.activation_dtype_bytes}


def _split_table(one: Any, layers: list[int], act_s_per_token: float, hop: float) -> Any:
    """A one-stage calibrated table split over stages of ``layers`` layers each."""
    from convergent.serve.costs import CostTable

    c0, c1, c2, c3, c4 = one.stage_coef[0]
    total = sum(layers)
    coefs = []
    for s, n in enumerate(layers):
        f = n / total
        last = s == len(layers) - 1
        coefs.append([c0 * f, c1 * f + (act_s_per_token if s > 0 else 0.0), c2 * f, c3 * f,
                      c4 if last else 0.0])
    return CostTable(layers_per_stage=list(layers), stage_coef=coefs, hop=hop,
                     source=f"{one.source}, split over {len(layers)} stages by layers + PCIe")


def project_pipeline(batch_log: dict[int, dict], step_device_s: dict[int, float],
                     host_s_per_step: float, requests: list[tuple[int, int, int]],
                     mcfg: Any, num_blocks: int, block_size: int, sched: Any,
                     link: PipelineLink | None = None) -> dict[str, Any]:
    """TD-Pipe and interleaved pipelining on ``link.stages`` GPUs, simulated on a cost
    table calibrated from one GPU's run (see the module's docstring). ``requests`` are the
    simulator's ``(input_len, output_len, predicted_len)``; ``num_blocks`` the KV blocks of
    the whole pipeline; ``sched`` the ``serve.scheduler`` section (its ``kind`` is set)."""
    from bench.serve.sim import simulate
    from convergent.models.layersplit import split_layers
    from convergent.serve.costs import CostTable, calibrate_from_run

    link = link or PipelineLink()
    # the run's log with each step's stage interval replaced by its device time
    log = {bid: {**e, "stages": {0: (e["submit"], e["submit"] + step_device_s[bid])}}
           for bid, e in batch_log.items() if bid in step_device_s}
    one = calibrate_from_run(log, CostTable(layers_per_stage=[mcfg.num_hidden_layers]))
    layers = [len(x) for x in split_layers(mcfg.num_hidden_layers, link.stages)]
    act = mcfg.hidden_size * link.activation_dtype_bytes / link.link_bytes_per_s
    table = _split_table(one, layers, act, link.link_latency_s)
    out: dict[str, Any] = {}
    for kind in ("interleaved", "tdpipe"):
        res = simulate(kind, requests, table, num_blocks, block_size, sched,
                       engine_overhead=host_s_per_step)
        out[kind] = res.to_dict()
    ti, tt = out["interleaved"]["output_tok_s"], out["tdpipe"]["output_tok_s"]
    return {
        "tdpipe_tok_s": tt, "interleaved_tok_s": ti, "ratio": tt / ti if ti else None,
        "assumptions": {
            **link.describe(mcfg.hidden_size),
            "gpus": "the measured GPU's costs on every stage (one stage's table split by layers)",
            "one_gpu_fit": {"coef": one.stage_coef[0], "features":
                            "[1, tokens, prefill_pairs, decode_ctx, sampled] -> seconds",
                            "steps": len(log)},
            "engine_host_s_per_micro_batch": host_s_per_step,
            "kv_blocks": num_blocks, "block_size": block_size,
            "max_num_seqs_per_micro_batch": sched.max_num_seqs,
            "max_batched_tokens": sched.max_batched_tokens,
            "tdpipe_max_wait_s": sched.tdpipe_max_wait_s,
            "predicted_len": "the request's max_tokens (exact: EOS ignored)"},
        "runs": out,
    }
