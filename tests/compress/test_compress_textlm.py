"""The real-text language model: a BPE tokenizer trained on the stdlib sources (split by
file, deterministic), a tiny Llama trained on it by DDP over 2 gloo processes, exported
with its tokenizer, and served as text over HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from convergent.data.textcorpus import EOT, TextConfig, corpus_files, prepare_corpus

TINY = ["text.source=stdlib", "text.max_files=24", "text.vocab_size=300"]


def test_corpus_split_by_file_and_tokenizer_are_deterministic(tmp_path):
    cfg = TextConfig(source="stdlib", max_files=24, vocab_size=300, cache_dir=str(tmp_path / "a"))
    root, train, val = corpus_files(cfg)
    assert val and train and not set(train) & set(val) and len(train) + len(val) == 24
    a = prepare_corpus(cfg)
    b = prepare_corpus(cfg.model_copy(update={"cache_dir": str(tmp_path / "b")}))
    assert (a.path / "tokenizer.json").read_bytes() == (b.path / "tokenizer.json").read_bytes()
    assert (a.train == b.train).all() and (a.val == b.val).all()
    assert a.vocab_size == 300 and a.meta["val_file_list"] == val
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(a.path / "tokenizer.json"))
    text = "def f(x):\n    return x  # ünïcode\n"
    assert tok.decode(tok.encode(text).ids) == text  # byte-level: every text round-trips
    assert tok.token_to_id(EOT) == a.eot_id
    assert int((a.train == a.eot_id).sum()) == len(train)  # one EOT after each file
    assert prepare_corpus(cfg).path == a.path  # the cache is reused


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_text_lm_trains_with_ddp_and_serves_text_over_http(tmp_path):
    from convergent.models.llama import load_pretrained
    from convergent.serve.tokenizer import HFTokenizer
    from tests.train.trainhelpers import run_training, val_records

    overrides = [
        *TINY, f"text.cache_dir={tmp_path / 'cache'}", "train.device=cpu", "model.kind=llama",
        "model.hidden=32", "model.layers=2", "model.heads=2", "train.steps=12",
        "train.seq_len=32", "train.global_batch_seqs=8", "train.val_every=6",
        "train.val_max_batches=2", "train.warmup_steps=2", "train.lr=3e-3",
        "checkpoint.interval=0", "metrics.tensorboard=false",
    ]
    res, recs, run = run_training(tmp_path, overrides, 2, "lm")
    assert recs[-1].loss < recs[0].loss - 0.3  # it learned from the text
    vals = val_records(run)
    assert len(vals) == 2 and math.isfinite(vals[-1].perplexity)
    assert vals[-1].perplexity < 300  # below the uniform distribution's
    final = Path(res.final_dir)
    assert (final / "tokenizer.json").is_file()
    cfg = json.loads((final / "config.json").read_text())
    tok = HFTokenizer(final)
    assert cfg["vocab_size"] == 300 and cfg["eos_token_id"] == tok.eos_ids[0]

    # the reference: the exported model's greedy continuation, stopped at EOS
    prompt = "import os\n\ndef "
    ids = load_pretrained(final).generate_greedy(tok.encode(prompt), 12)
    if tok.eos_ids[0] in ids:
        ids = ids[: ids.index(tok.eos_ids[0])]
    port = _free_port()
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-c", "from convergent.cli import entry; entry()", "serve",
         "--model", str(final), "--port", str(port), "--set", f"run.root={tmp_path}",
         "--set", "serve.scheduler.kind=sequential", "--set", "serve.scheduler.stages=1"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert isinstance(text, str) and text == tok.decode(ids)
    assert len(text) >= 4  # text decoded by the checkpoint's own tokenizer (tiny model: mostly spaces)


@pytest.mark.parametrize("bad", ["text.vocab_size=100", "text.val_fraction=0.9"])
def test_text_config_bounds(bad):
    from convergent.cli import main

    assert main(["train", "--print-launch", "--set", "model.kind=llama", "--set", bad]) == 2
