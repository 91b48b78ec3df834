"""A stage runner with decode graphs and the steps to drive it directly (prefill a few
sequences, then one decode step run eagerly and through the padded static buffers)."""

from __future__ import annotations

import torch

from convergent.serve.config import EngineConfig
from convergent.serve.messages import BatchMeta
from convergent.serve.sampling import RowParams, SamplingParams
from convergent.serve.stage import StageRunner, StageSpec

BS, BLOCKS_PER_SEQ, NUM_BLOCKS = 4, 8, 72


def make_runner(model_dir, backend="sdpa_gather", device="cpu", dtype="float32",
                mode="on", max_num_seqs=8) -> StageRunner:
    eng = EngineConfig(block_size=BS, max_model_len=BS * BLOCKS_PER_SEQ, attention_backend=backend,
                       cuda_graphs=mode, device=device, dtype=dtype)
    return StageRunner(StageSpec(str(model_dir), 0, 1, NUM_BLOCKS, eng, max_num_seqs=max_num_seqs))


def _table(i: int) -> list[int]:
    return list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ))


def _slot(i: int, pos: int) -> int:
    return _table(i)[pos // BS] * BS + pos % BS


def _meta(bid, seqs: list[tuple[int, list[int], int]]) -> BatchMeta:
    """``seqs``: (sequence, its new tokens, their first position); every sequence samples."""
    m = BatchMeta(bid, [], [], [], [], [], [], [], [], RowParams())
    for i, toks, start in seqs:
        end = start + len(toks)
        m.input_ids += toks
        m.positions += range(start, end)
        m.slots += [_slot(i, p) for p in range(start, end)]
        m.query_lens.append(len(toks))
        m.context_lens.append(end)
        m.block_tables.append(_table(i))
        m.sample_rows.append(len(m.positions) - 1)
        m.sample_rids.append(i)
        m.sampling.add(SamplingParams(), end)
    return m


def prefill(runner: StageRunner, prompts: list[list[int]]) -> tuple[dict[int, int], list[int]]:
    """Prefill ``prompts`` as sequences 0..n-1: their first tokens and lengths."""
    out = runner.run(_meta(0, [(i, p, 0) for i, p in enumerate(prompts)]))
    return out.tokens, [len(p) for p in prompts]


def decode_meta(tokens: dict[int, int], lens: list[int]) -> BatchMeta:
    return _meta(1, [(i, [tokens[i]], lens[i]) for i in sorted(tokens)])


def eager_logits(runner: StageRunner, meta: BatchMeta) -> torch.Tensor:
    """The eager path's logits of a step (what StageRunner.run computes without graphs)."""
    from convergent.models.llama import PagedBatch

    with torch.inference_mode():
        b = PagedBatch.build(runner.buffers, meta.positions, meta.slots, meta.query_lens,
                             meta.context_lens, meta.block_tables, BS, backend=runner.backend,
                             extras=[meta.input_ids])
        h = runner.model.model.forward_paged(b.extras[0], b, runner.kv.layers)
        return runner.model.logits(h).float()


def static_logits(runner: StageRunner, meta: BatchMeta) -> torch.Tensor:
    with torch.inference_mode():
        return runner.graphs.run(meta.input_ids, meta.positions, meta.slots, meta.context_lens,
                                 meta.block_tables).clone()


def mixed_logits(runner: StageRunner, meta: BatchMeta) -> torch.Tensor:
    """The piecewise runner's logits of every row of a step (static buffers, graphs where
    captured)."""
    from convergent.models.llama import PagedBatch

    with torch.inference_mode():
        b = PagedBatch.build(runner.buffers, meta.positions, meta.slots, meta.query_lens,
                             meta.context_lens, meta.block_tables, BS, backend=runner.backend,
                             extras=[meta.input_ids])
        return runner.model.logits(runner.mixed.run(b.extras[0], b)).float()


def mixed_meta(tokens: dict[int, int], lens: list[int], prompt: list[int]) -> BatchMeta:
    """A mixed step: one decode token for each prefilled sequence and a new prompt as the
    next sequence."""
    return _meta(2, [*[(i, [tokens[i]], lens[i]) for i in sorted(tokens)],
                     (len(lens), prompt, 0)])
