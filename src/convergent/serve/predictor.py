"""Output-length predictors: a small learned classifier over prompt features, an oracle
and a constant (for ablation).

The learned predictor is multinomial logistic regression (numpy) over features of the
prompt text — log length plus hashed word unigrams/bigrams of its first words — that
predicts an output-length *bucket*; the prediction in tokens is the mean training
length of that bucket. It is trained on a trace (:mod:`convergent.serve.workload`).
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from convergent.core.fsutil import dumps_json

__all__ = [
    "LengthPredictor",
    "LearnedPredictor",
    "OraclePredictor",
    "ConstantPredictor",
    "DEFAULT_BUCKETS",
    "make_predictor",
]

DEFAULT_BUCKETS = (0, 32, 64, 128, 256, 384, 512, 768, 1025)
N_HASH = 128


def prompt_features(text: str, n_hash: int = N_HASH, n_words: int = 8) -> np.ndarray:
    """Feature vector of a prompt: bias, log length, hashed (bi)grams of the first words."""
    f = np.zeros(n_hash + 2, dtype=np.float64)
    f[0] = 1.0
    f[1] = math.log1p(len(text.encode("utf-8"))) / 7.0
    words = text.lower().split()[:n_words]
    grams = words + [a + "_" + b for a, b in zip(words, words[1:], strict=False)]
    for g in grams:
        f[2 + zlib.crc32(g.encode()) % n_hash] += 1.0
    return f


class LengthPredictor:
    """Interface: ``predict(prompt_text, true_len=None) -> predicted output tokens``."""

    name = "base"

    def predict(self, prompt: str, true_len: int | None = None) -> int:  # pragma: no cover
        raise NotImplementedError


class OraclePredictor(LengthPredictor):
    """Knows the true output length (upper bound for ablation)."""

    name = "oracle"

    def __init__(self, fallback: int = 256) -> None:
        self.fallback = fallback

    def predict(self, prompt: str, true_len: int | None = None) -> int:
        return int(true_len) if true_len is not None else self.fallback


class ConstantPredictor(LengthPredictor):
    """Always the same length (default: the trace median)."""

    name = "constant"

    def __init__(self, value: int = 340) -> None:
        self.value = int(value)

    def predict(self, prompt: str, true_len: int | None = None) -> int:
        return self.value


class LearnedPredictor(LengthPredictor):
    """Softmax classifier over prompt features -> length bucket -> bucket mean length."""

    name = "learned"

    def __init__(self, buckets: Sequence[int] = DEFAULT_BUCKETS) -> None:
        self.buckets = list(buckets)
        self.k = len(self.buckets) - 1
        self.w = np.zeros((N_HASH + 2, self.k))
        self.bucket_mean = np.array(
            [(a + b) / 2 for a, b in zip(self.buckets, self.buckets[1:], strict=False)]
        )

    def bucket_of(self, lengths: np.ndarray) -> np.ndarray:
        return np.clip(np.searchsorted(self.buckets, lengths, side="right") - 1, 0, self.k - 1)

    def fit(
        self,
        prompts: Sequence[str],
        lengths: Sequence[int],
        epochs: int = 300,
        lr: float = 0.5,
        l2: float = 1e-3,
        seed: int = 0,
    ) -> LearnedPredictor:
        """Full-batch gradient descent on cross-entropy; returns self."""
        x = np.stack([prompt_features(p) for p in prompts])
        y = self.bucket_of(np.asarray(lengths))
        lens = np.asarray(lengths, dtype=np.float64)
        for b in range(self.k):
            if (y == b).any():
                self.bucket_mean[b] = lens[y == b].mean()
        onehot = np.eye(self.k)[y]
        rng = np.random.default_rng(seed)
        self.w = rng.normal(0, 0.01, self.w.shape)
        for _ in range(epochs):
            p = self._softmax(x @ self.w)
            grad = x.T @ (p - onehot) / len(x) + l2 * self.w
            self.w -= lr * grad
        return self

    @staticmethod
    def _softmax(z: np.ndarray) -> np.ndarray:
        z = z - z.max(axis=-1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=-1, keepdims=True)

    def predict_bucket(self, prompt: str) -> int:
        return int(np.argmax(prompt_features(prompt) @ self.w))

    def predict(self, prompt: str, true_len: int | None = None) -> int:
        return max(1, int(round(self.bucket_mean[self.predict_bucket(prompt)])))

    def accuracy(self, prompts: Sequence[str], lengths: Sequence[int]) -> dict:
        """Bucket accuracy, within-one-bucket accuracy and mean absolute error (tokens)."""
        yb = self.bucket_of(np.asarray(lengths))
        pb = np.array([self.predict_bucket(p) for p in prompts])
        pl = self.bucket_mean[pb]
        return {
            "bucket_acc": float((pb == yb).mean()),
            "within_one_bucket": float((np.abs(pb - yb) <= 1).mean()),
            "mae_tokens": float(np.abs(pl - np.asarray(lengths)).mean()),
        }

    def save(self, path: str | Path) -> None:
        from convergent.core.fsutil import atomic_write_text

        atomic_write_text(
            path,
            dumps_json(
                {
                    "buckets": self.buckets,
                    "w": self.w.tolist(),
                    "bucket_mean": self.bucket_mean.tolist(),
                }
            ),
        )

    @classmethod
    def load(cls, path: str | Path) -> LearnedPredictor:
        d = json.loads(Path(path).read_text())
        p = cls(d["buckets"])
        p.w = np.asarray(d["w"])
        p.bucket_mean = np.asarray(d["bucket_mean"])
        return p


def make_predictor(
    kind: str,
    path: str = "",
    train_n: int = 2000,
    seed: int = 1234,
    length_scale: float = 1.0,
    input_scale: float | None = None,
) -> LengthPredictor:
    """Build a predictor by name; ``learned`` loads ``path`` or trains on a fresh trace
    whose outputs are scaled by ``length_scale`` and prompts by ``input_scale`` (default:
    ``length_scale``), like the trace it will predict."""
    from convergent.serve.workload import make_trace, scale_trace

    if kind == "oracle":
        return OraclePredictor()
    trace = make_trace(train_n, seed=seed)
    in_scale = length_scale if input_scale is None else input_scale
    if length_scale != 1.0 or in_scale != 1.0:
        trace = scale_trace(trace, in_scale, output_scale=length_scale)
    if kind == "constant":
        return ConstantPredictor(int(np.median([r.output_len for r in trace])))
    if kind == "learned":
        if path:
            return LearnedPredictor.load(path)
        buckets = [round(b * length_scale) for b in DEFAULT_BUCKETS]
        buckets = sorted(set(buckets))
        return LearnedPredictor(buckets).fit(
            [r.prompt for r in trace], [r.output_len for r in trace]
        )
    raise ValueError(f"unknown predictor {kind!r} (learned, oracle, constant)")
