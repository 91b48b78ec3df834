"""A seeded, ShareGPT-like offline trace.

Published ShareGPT statistics after the usual filter (first turns): log-normal fits
input ``mu=4.19, sigma=1.20`` and output ``mu=5.83, sigma=1.01`` tokens, output capped at
1024. The log-normal fits imply input median ``exp(4.19) = 66`` and p90 ``307``, output
median ``340`` and p90 ``1241 -> 1024`` (cap); the quoted empirical values (input median
~58, p90 ~381; output median ~473, p90 ~868) differ from the fits — we sample the fits
and report both (see :func:`trace_stats`).

So that output length is (partly) predictable from the prompt, as with real
instructions, each prompt's text says what kind of answer it wants: the output length is
drawn first, a *task kind* is picked from a noisy copy of it, and the prompt is built
from that kind's phrasing plus filler words up to the sampled input length. The marginal
length distributions are exactly the log-normal fits.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["TraceRequest", "make_trace", "trace_stats", "TASK_KINDS", "scale_trace", "uniform_trace"]

INPUT_MU, INPUT_SIGMA = 4.19, 1.20
OUTPUT_MU, OUTPUT_SIGMA = 5.83, 1.01
OUTPUT_CAP = 1024

# kind -> phrasing; ordered by typical answer length (short to long)
TASK_KINDS: list[tuple[str, str]] = [
    ("yesno", "Answer yes or no:"),
    ("word", "In one word, name"),
    ("fact", "Give a short fact about"),
    ("translate", "Translate this sentence:"),
    ("explain", "Explain briefly how"),
    ("list", "List the main steps to"),
    ("code", "Write a Python function that"),
    ("essay", "Write a detailed essay about"),
]
_FILLER = (
    "the data model system value time energy process network graph memory cache layer "
    "token stage batch request city river music history science market engine protein "
    "planet theory language design error signal"
).split()


@dataclass
class TraceRequest:
    """One request of a trace: the prompt text, its token length and the true output length."""

    rid: int
    prompt: str
    input_len: int  # tokens (bytes + BOS with the byte tokenizer)
    output_len: int
    kind: str

    def to_dict(self) -> dict:
        return asdict(self)


def _prompt_text(rng: np.random.Generator, kind_idx: int, n_bytes: int) -> str:
    head = TASK_KINDS[kind_idx][1] + " "
    words = []
    size = len(head)
    while size < n_bytes:
        w = _FILLER[int(rng.integers(len(_FILLER)))]
        words.append(w)
        size += len(w) + 1
    text = head + " ".join(words)
    return text[: max(n_bytes, 1)]


def requests_from(rng: np.random.Generator, kinds: np.ndarray, inp: np.ndarray,
                  out: np.ndarray) -> list[TraceRequest]:
    """Trace requests with a prompt of ``inp[i]`` tokens (BOS included) of kind ``kinds[i]``
    and ``out[i]`` output tokens."""
    reqs = []
    for i in range(len(kinds)):
        text = _prompt_text(rng, int(kinds[i]), int(inp[i]) - 1)  # -1: BOS
        reqs.append(
            TraceRequest(i, text, len(text.encode()) + 1, int(out[i]), TASK_KINDS[kinds[i]][0])
        )
    return reqs


def make_trace(
    n: int,
    seed: int = 0,
    max_input: int = 1024,
    output_cap: int = OUTPUT_CAP,
    kind_noise: float = 0.35,
) -> list[TraceRequest]:
    """``n`` requests with log-normal input/output lengths (tokens), reproducible by seed.

    Input lengths are clipped to ``[4, max_input]``; outputs to ``[1, output_cap]``.
    ``kind_noise`` (in log-length units) controls how well the prompt's kind reveals its
    output length.
    """
    rng = np.random.default_rng(seed)
    inp = np.exp(rng.normal(INPUT_MU, INPUT_SIGMA, n))
    z = rng.normal(0.0, 1.0, n)
    out = np.exp(OUTPUT_MU + OUTPUT_SIGMA * z)
    inp = np.clip(np.round(inp), 4, max_input).astype(int)
    out = np.clip(np.round(out), 1, output_cap).astype(int)
    # noisy standardised log-length -> one of the kinds (equal-probability bins)
    zn = (z + rng.normal(0.0, kind_noise / OUTPUT_SIGMA, n)) / math.sqrt(
        1 + (kind_noise / OUTPUT_SIGMA) ** 2
    )
    k = len(TASK_KINDS)
    edges = np.quantile(rng.normal(0, 1, 20000), np.linspace(0, 1, k + 1)[1:-1])
    kinds = np.searchsorted(edges, zn)
    return requests_from(rng, kinds, inp, out)


def uniform_trace(
    n: int = 1000,
    seed: int = 0,
    input_range: tuple[int, int] = (128, 1024),
    output_range: tuple[int, int] = (64, 512),
) -> list[TraceRequest]:
    """``n`` requests with prompt and output lengths (tokens, BOS included) drawn uniformly
    from the inclusive ``input_range`` and ``output_range``, reproducible by seed; every
    request arrives at once (an offline batch: the GPU serving benchmark of issue 39 item 9,
    1,000 requests, prompts 128-1,024, outputs 64-512). The prompt's kind follows its output
    length's octile, as in :func:`make_trace`."""
    lo_in, hi_in = input_range
    lo_out, hi_out = output_range
    if not 2 <= lo_in <= hi_in or not 1 <= lo_out <= hi_out:
        raise ValueError(f"bad ranges: input {input_range}, output {output_range}")
    rng = np.random.default_rng(seed)
    inp = rng.integers(lo_in, hi_in + 1, n)
    out = rng.integers(lo_out, hi_out + 1, n)
    k = len(TASK_KINDS)
    kinds = np.minimum((out - lo_out) * k // (hi_out - lo_out + 1), k - 1)
    return requests_from(rng, kinds, inp, out)


def scale_trace(
    trace: list[TraceRequest], scale: float, min_len: int = 2, output_scale: float | None = None
) -> list[TraceRequest]:
    """Shrink input lengths by ``scale`` and output lengths by ``output_scale`` (default:
    ``scale``), for small-machine benchmarks."""
    out_scale = scale if output_scale is None else output_scale
    out = []
    for r in trace:
        n_in = max(min_len, round(r.input_len * scale))
        text = r.prompt.encode()[: n_in - 1].decode("utf-8", errors="ignore")
        out.append(
            TraceRequest(
                r.rid, text, len(text.encode()) + 1, max(1, round(r.output_len * out_scale)), r.kind
            )
        )
    return out


def trace_stats(trace: list[TraceRequest]) -> dict:
    """Medians / p90 of input and output lengths, with the log-normal expectations."""
    inp = np.array([r.input_len for r in trace])
    out = np.array([r.output_len for r in trace])
    z90 = 1.2815515655446004
    return {
        "n": len(trace),
        "input_median": float(np.median(inp)),
        "input_p90": float(np.percentile(inp, 90)),
        "output_median": float(np.median(out)),
        "output_p90": float(np.percentile(out, 90)),
        "expected_from_fit": {
            "input_median": math.exp(INPUT_MU),
            "input_p90": math.exp(INPUT_MU + z90 * INPUT_SIGMA),
            "output_median": math.exp(OUTPUT_MU),
            "output_p90": min(OUTPUT_CAP, math.exp(OUTPUT_MU + z90 * OUTPUT_SIGMA)),
        },
        "published_empirical": {
            "input_median": 58,
            "input_p90": 381,
            "output_median": 473,
            "output_p90": 868,
        },
    }
