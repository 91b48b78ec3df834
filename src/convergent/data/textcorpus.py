"""A text corpus that needs no download, its BPE tokenizer and its token streams.

``text.source: stdlib`` reads the Python standard library's own ``*.py`` sources on
this machine (``sysconfig``'s ``stdlib`` path, without ``site-packages`` and, unless
``text.include_tests``, without the ``test``/``tests`` packages); a directory reads its
``*.py``, ``*.txt``, ``*.md`` and ``*.rst`` files. Files are split into train and
validation **by file** (a file is in validation when the CRC32 of its relative path
falls under ``text.val_fraction``), so the split depends only on the file names.

A byte-level BPE tokenizer (the ``tokenizers`` library, GPT-2 style: every byte is a
token, so any text round-trips) is trained on the training files only, with one special
token ``<|endoftext|>`` that separates files. :func:`prepare_corpus` writes, once per
distinct setting, ``tokenizer.json``, ``tokenizer_config.json``, ``train.npy``,
``val.npy`` (token ids) and ``meta.json`` into ``<cache>/<key>/`` (built in a temporary
directory and renamed, so a crash never leaves a half-made cache); later calls load it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from convergent.core.errors import ConfigError, InputError
from convergent.core.fsutil import atomic_write_text, dumps_json
from convergent.data.config import TextConfig

__all__ = ["EOT", "TextConfig", "TextCorpus", "corpus_files", "prepare_corpus", "train_tokenizer"]

EOT = "<|endoftext|>"
SUFFIXES = (".py", ".txt", ".md", ".rst")
FORMAT = 1


@dataclass
class TextCorpus:
    """A prepared corpus: its directory, token streams and the tokenizer's facts."""

    path: Path
    train: np.ndarray  # token ids of the training files, EOT between files
    val: np.ndarray
    vocab_size: int
    eot_id: int
    meta: dict

    @property
    def tokenizer_files(self) -> list[Path]:
        return [self.path / "tokenizer.json", self.path / "tokenizer_config.json"]


def source_root(source: str) -> Path:
    """The directory a ``text.source`` names."""
    if source == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    p = Path(source)
    if not p.is_dir():
        raise ConfigError(f"text.source: {source} is not a directory (nor 'stdlib')")
    return p


def corpus_files(cfg: TextConfig) -> tuple[Path, list[str], list[str]]:
    """``(root, train files, validation files)`` as sorted relative paths."""
    root = source_root(cfg.source)
    skip = {"site-packages", "dist-packages", "__pycache__"}
    if cfg.source == "stdlib" and not cfg.include_tests:
        skip |= {"test", "tests", "idle_test"}
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for f in filenames:
            if f.endswith(SUFFIXES):
                rels.append(Path(dirpath, f).relative_to(root).as_posix())
    rels.sort()
    if cfg.max_files is not None:  # a spread-out subset: the smallest hashes
        rels = sorted(sorted(rels, key=_crc)[: cfg.max_files])
    cut = int(cfg.val_fraction * 10_000)
    val = [r for r in rels if _crc(r) % 10_000 < cut]
    train = [r for r in rels if _crc(r) % 10_000 >= cut]
    if len(rels) < 2:
        raise InputError(f"text.source: {root} holds {len(rels)} text files; at least 2 needed")
    if not val:  # too few files for the fraction: the file with the smallest hash
        val = [min(train, key=lambda r: _crc(r) % 10_000)]
        train.remove(val[0])
    if not train:
        raise InputError(f"text.source: every file of {root} fell into validation")
    return root, train, val


def _crc(rel: str) -> int:
    return zlib.crc32(rel.encode("utf-8"))


def _read(root: Path, rel: str) -> str:
    return (root / rel).read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def _key(cfg: TextConfig, root: Path, train: list[str], val: list[str]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([FORMAT, str(root.resolve()), cfg.vocab_size, train, val]).encode())
    for rel in train + val:
        h.update(str((root / rel).stat().st_size).encode())
    return h.hexdigest()[:16]


def cache_root(cfg: TextConfig, run_root: str | Path) -> Path:
    return Path(cfg.cache_dir) if cfg.cache_dir else Path(run_root) / "text-cache"


def prepare_corpus(cfg: TextConfig, run_root: str | Path = "runs", build: bool = True) -> TextCorpus:
    """Load the prepared corpus of ``cfg``, building it first when ``build`` and absent.

    ``build=False`` on a missing cache raises :class:`FileNotFoundError` (ranks other
    than 0 wait for rank 0 to build it).
    """
    if not cfg.source:
        raise ConfigError("text.source is empty: no text corpus to prepare")
    root, train, val = corpus_files(cfg)
    d = cache_root(cfg, run_root) / _key(cfg, root, train, val)
    if not (d / "meta.json").is_file():
        if not build:
            raise FileNotFoundError(d)
        _build(cfg, root, train, val, d)
    meta = json.loads((d / "meta.json").read_text(encoding="utf-8"))
    return TextCorpus(
        d, np.load(d / "train.npy"), np.load(d / "val.npy"), meta["vocab_size"], meta["eot_id"], meta
    )


def _build(cfg: TextConfig, root: Path, train: list[str], val: list[str], d: Path) -> None:
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = d.parent / f".{d.name}.{os.getpid()}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        texts = [_read(root, r) for r in train]
        tok = train_tokenizer(texts, cfg.vocab_size)
        eot = tok.token_to_id(EOT)
        dtype = np.uint16 if tok.get_vocab_size() <= 65535 else np.int32

        def stream(docs: list[str]) -> np.ndarray:
            ids: list[int] = []
            for enc in tok.encode_batch(docs, add_special_tokens=False):
                ids.extend(enc.ids)
                ids.append(eot)
            return np.asarray(ids, dtype=dtype)

        tr, va = stream(texts), stream([_read(root, r) for r in val])
        tok.save(str(tmp / "tokenizer.json"))
        tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT,
                "bos_token": EOT, "unk_token": None, "model_max_length": 1_000_000}
        atomic_write_text(tmp / "tokenizer_config.json", dumps_json(tcfg, indent=2))
        np.save(tmp / "train.npy", tr)
        np.save(tmp / "val.npy", va)
        meta = {"format": FORMAT, "source": cfg.source, "root": str(root),
                "vocab_size": tok.get_vocab_size(), "eot_id": eot,
                "train_files": len(train), "val_files": len(val),
                "train_tokens": int(tr.size), "val_tokens": int(va.size),
                "train_bytes": sum(len(t.encode("utf-8")) for t in texts),
                "val_file_list": val}
        atomic_write_text(tmp / "meta.json", dumps_json(meta, indent=1))
        try:
            tmp.rename(d)
        except OSError:  # another process built it meanwhile: keep theirs
            if not (d / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
