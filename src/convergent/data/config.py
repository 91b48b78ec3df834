"""Config of the dataset store (``data`` section)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from convergent.core.configbase import PathStr, Section, Seed


class DataConfig(Section):
    """Shard layout, reader and node-local cache settings (defaults fit a 2-core laptop)."""

    shard_bytes: int = Field(128 * 2**20, ge=4096, le=2**40)  # target shard size, bytes (64-256 MiB on a cluster)
    compression: Literal["none", "zstd"] = "zstd"  # per-record, kept only where it shrinks the record
    inline_bytes: int = Field(256, ge=0, le=2**24)  # bytes-schema payloads up to this size live in the index
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0, allow_inf_nan=False)  # fraction of *molecules* held out
    seed: Seed = 0  # split and shuffle seed
    shuffle: bool = True  # block shuffle with shard locality, from (seed, epoch)
    block_size: int = Field(16384, ge=1)  # shuffle window, samples
    drop_last: bool = False  # equal per-rank counts by dropping the tail (default: pad)
    cache_dir: PathStr | None = None  # node-local cache directory (None: read shards in place)
    cache_bytes: int = Field(10 * 2**30, gt=0)  # cache byte budget
    prefetch_shards: int = Field(2, ge=0)  # shards copied into the cache ahead of the reader


class TextConfig(Section):
    """The text corpus of the language-model task (``model.kind: llama``).

    ``source``: empty = the synthetic token stream of ``train.vocab_size`` tokens;
    ``stdlib`` = the Python standard library sources on this machine; or a directory of
    text files. ``cache_dir``: where the tokenizer and token streams are kept (default
    ``<run.root>/text-cache``).
    """

    source: str = ""
    vocab_size: int = Field(4096, ge=260, le=65535)  # BPE vocabulary incl. 256 bytes + EOT
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5, allow_inf_nan=False)
    max_files: int | None = Field(None, ge=2, le=1_000_000)  # a deterministic subset (tests)
    include_tests: bool = False  # stdlib: also the test/tests packages
    cache_dir: PathStr | None = None
    # start from this HF Llama checkpoint (e.g. a pruned model: recovery fine-tuning)
    init_from: PathStr | None = None
    # knowledge distillation: this HF Llama (same tokenizer) is the teacher; the loss is
    # (1 - kd_alpha) * CE(labels) + kd_alpha * T^2 * KL(teacher_T || student_T); the defaults
    # (0.5, T=1) beat (0.9, T=2) on the stdlib Llama of bench/compress/inference.py
    teacher: PathStr | None = None
    kd_alpha: float = Field(0.5, ge=0.0, le=1.0, allow_inf_nan=False)
    kd_temperature: float = Field(1.0, ge=0.5, le=20.0, allow_inf_nan=False)
