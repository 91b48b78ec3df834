"""A trained Llama LM is exported in the Hugging Face layout that ``convergent serve`` loads.

The run's ``ckpt/final`` holds ``config.json`` + ``model.safetensors`` (HF names); the
serve loader (whole model and as two pipeline stages, as serve's stage workers load it)
and transformers' ``LlamaForCausalLM`` both load it and give the trained model's logits.
"""

from __future__ import annotations

import json

import torch

from tests.train.trainhelpers import LM_BASE, run_training


def test_trained_lm_export_loads_in_serve_and_transformers(tmp_path):
    transformers = __import__("transformers")
    from convergent.config import load_config
    from convergent.models.llama import load_pretrained
    from convergent.serve.stage import split_layers
    from convergent.train.checkpoint import load_full_model
    from convergent.train.tasks import make_task

    res, recs, run = run_training(tmp_path, [*LM_BASE, "parallel.strategy=single"], 1, "lm")
    assert recs[-1].loss < recs[0].loss  # it trained
    final = res.final_dir
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 2
    # reference: the weights of the last DCP checkpoint in the training model class
    task = make_task(load_config(run.config, []))
    trained = load_full_model(res.checkpoint, task.build_model()).eval()
    ids = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = trained(ids)
        served = load_pretrained(final)(ids)
        h = ids
        stages = split_layers(cfg["num_hidden_layers"], 2)
        for s, layers in enumerate(stages):
            part = load_pretrained(final, layers, embed=s == 0, head=s == len(stages) - 1)
            h = part(h)
        hf = transformers.LlamaForCausalLM.from_pretrained(str(final)).eval()
        hf_logits = hf(ids).logits
    assert torch.equal(served, ref)
    assert torch.equal(h, ref)
    assert torch.allclose(hf_logits, ref, atol=1e-5, rtol=1e-5)
    # the export is the trained model, not its initialisation
    init = task.build_model().eval()
    with torch.no_grad():
        assert not torch.allclose(init(ids), ref, atol=1e-3)
