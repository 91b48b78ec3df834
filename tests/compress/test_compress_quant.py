"""INT8 quantisation (convergent.compress): error bounds, memory, checkpoints that load
back, the serving engine and screening with ``quantize``.

Tolerances: per-channel INT8 rounds each weight by at most half its row's scale
(``amax / 127 / 2``, ~1% rms of a Gaussian row), so a layer's output error is bounded
relative to its size; through the 4 layers of the tiny random Llama the relative L2 error
of the logits is ~2.6% (below ``REL_TOL`` = 5%), of the surrogate's forces ~1%. Dynamic
INT8 also quantises activations (per tensor, 7-bit range on x86's fbgemm), ~9% here
(below ``DYN_TOL`` = 15%).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from convergent.compress.qcheckpoint import (
    load_llama,
    load_surrogate,
    quant_info,
    save_quantized_llama,
    save_quantized_surrogate,
)
from convergent.compress.quant import (
    Int8Linear,
    quantize_dynamic_int8,
    quantize_per_channel,
    quantize_weight_only,
    weight_bytes,
)
from convergent.core.errors import ConfigError
from convergent.models.llama import LlamaConfig, LlamaForCausalLM, load_pretrained, save_pretrained

REL_TOL = 0.05
DYN_TOL = 0.15
# fp32 rounding of a 64-term dot product in another order (ATen's GEMM kernels differ by
# ISA): a few eps of the largest output; 32 leaves ~10x over what was measured
FP32_ULPS = 32


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("llama") / "fp32"
    model = LlamaForCausalLM(LlamaConfig.tiny())
    model.reset_parameters(std=0.1, seed=0)  # logits far from uniform: argmax is stable
    save_pretrained(model, d)
    return d


def test_per_channel_rounding_is_within_half_a_step():
    w = torch.randn(37, 19) * torch.logspace(-3, 1, 37)[:, None]  # rows of very different size
    q, s = quantize_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (37,)
    assert int(q.abs().max()) == 127  # the largest entry of each row uses the full range
    err = (q.float() * s[:, None] - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-7 * w.abs()).all())


@pytest.mark.numerics
def test_int8_llama_logits_close_memory_quarter_and_gradients_flow(llama_dir):
    model = load_pretrained(llama_dir)
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids)
    q = copy.deepcopy(model)
    info = quantize_weight_only(q)
    assert "lm_head" in info.modules and "model.embed_tokens" in info.modules
    assert not any(isinstance(m, torch.nn.Linear) for m in q.modules())
    with torch.no_grad():
        out = q(ids)
    assert rel_err(out, ref) < REL_TOL
    assert weight_bytes(q) / weight_bytes(model) <= 0.3
    # the bf16 kernel path (torch._weight_int8pack_mm) and the dequantised fp32 path agree
    lin = next(m for m in q.modules() if isinstance(m, Int8Linear))
    x = torch.randn(5, lin.in_features, requires_grad=True)
    y = lin(x)
    y.sum().backward()
    # Tolerances from the dtypes: the fp32 paths (scale after vs before the GEMM) differ in
    # rounding only, within FP32_ULPS x eps x the largest output (measured <= 3 under
    # ATen's default / AVX2 / AVX-512 kernels); the bf16 kernel rounds x, the scales and
    # the output to bf16 (<= eps/2 relative each, 1.5 eps together): 2 eps of bf16
    # (measured 0.36 eps).
    eps32, eps16 = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
    with torch.no_grad():
        ref_y = x @ lin.dequantized().T
        assert torch.allclose(y, ref_y, rtol=0, atol=FP32_ULPS * eps32 * float(ref_y.abs().max()))
        assert rel_err(lin(x.bfloat16()).float(), y) < 2 * eps16
    ref_g = lin.dequantized().sum(0).expand_as(x)
    assert torch.allclose(x.grad, ref_g, rtol=0, atol=FP32_ULPS * eps32 * float(ref_g.abs().max()))


@pytest.mark.numerics
def test_dynamic_int8_close_and_refuses_half_precision(llama_dir):
    model = load_pretrained(llama_dir)
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids)
        qmodel, info = quantize_dynamic_int8(model)
        out = qmodel(ids)
    assert info.method == "int8-dynamic" and "lm_head" in info.modules
    assert rel_err(out, ref) < DYN_TOL
    with pytest.raises(ConfigError, match="float32"):
        quantize_dynamic_int8(load_pretrained(llama_dir, dtype=torch.bfloat16))


def test_quantised_llama_checkpoint_loads_back_whole_and_as_stages(llama_dir, tmp_path):
    model = load_pretrained(llama_dir)
    info = quantize_weight_only(model)
    out = save_quantized_llama(model, info, tmp_path / "int8", source=llama_dir)
    meta = json.loads((out / "config.json").read_text())
    assert meta["convergent_quantization"]["method"] == "int8"
    assert quant_info(out).modules == info.modules and quant_info(llama_dir) is None
    # ~1/4 of the fp32 file on disk
    ratio = (out / "model.safetensors").stat().st_size / (llama_dir / "model.safetensors").stat().st_size
    assert ratio < 0.3
    ids = torch.randint(0, 320, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids)
        assert torch.equal(load_llama(out)(ids), ref)
        h = ids
        for s, layers in enumerate([range(0, 2), range(2, 4)]):
            h = load_llama(out, layers, embed=s == 0, head=s == 1)(h)
    assert torch.equal(h, ref)
    with pytest.raises(KeyError):  # a plain loader cannot mistake it for fp32 weights
        load_pretrained(out)
    with pytest.raises(ConfigError, match="already quantised"):
        load_llama(out, quantize_method="int8-dynamic")


@pytest.mark.numerics
def test_serving_engine_with_int8_matches_the_quantised_model(llama_dir):
    from convergent.serve.config import ServeConfig
    from convergent.serve.engine import Engine

    ref = load_llama(llama_dir, quantize_method="int8")
    prompts = [[5, 17, 99, 3], [250, 1, 2, 3, 4, 5, 6]]
    want = [ref.generate_greedy(p, 8) for p in prompts]
    cfg = ServeConfig(
        engine={"quantize": "int8"},
        scheduler={"kind": "sequential", "stages": 2, "profile_costs": False},
    )
    with Engine(llama_dir, cfg, ignore_eos=True) as eng:
        reqs = [eng.add_request(eng.make_request(p, 8)) for p in prompts]
        eng.run()
    assert [r.output for r in reqs] == want


# ----------------------------------------------------------------------------- surrogate


@pytest.fixture(scope="module")
def surrogate(tmp_path_factory):
    from ase.build import molecule

    from convergent.models.batching import atoms_to_record
    from convergent.models.config import ModelConfig
    from convergent.models.io import save_model
    from convergent.models.molecular import build_model

    cfg = ModelConfig(hidden=32, layers=2, heads=4)
    torch.manual_seed(0)
    model = build_model(cfg)
    d = tmp_path_factory.mktemp("sur") / "fp32"
    save_model(model, cfg, d)
    rng = np.random.default_rng(0)
    recs = []
    for i, name in enumerate(["H2O", "CH4", "NH3", "C2H6", "CH3OH", "HCN"] * 2):
        atoms = molecule(name)
        atoms.positions += rng.normal(0, 0.05, atoms.positions.shape)
        recs.append(atoms_to_record(atoms, key=str(i)))
    return d, cfg, recs


@pytest.mark.numerics
def test_int8_surrogate_energies_forces_close_and_checkpoint_loads_back(surrogate, tmp_path):
    from convergent.models.batching import collate_records
    from convergent.models.molecular import energy_and_forces

    d, cfg, recs = surrogate
    batch = collate_records(recs)
    fp = load_surrogate(d)
    q = load_surrogate(d, quantize_method="int8")
    e0, f0 = energy_and_forces(fp, batch, False)
    e1, f1 = energy_and_forces(q, batch, False)  # autograd forces through INT8 layers
    assert rel_err(e1, e0) < REL_TOL
    assert rel_err(f1, f0) < REL_TOL
    from convergent.compress.quant import quantize_weight_only as qwo

    plain = load_surrogate(d)
    info = qwo(plain, embeddings=False)
    out = save_quantized_surrogate(plain, cfg, info, tmp_path / "int8")
    back = load_surrogate(out)
    e2, f2 = energy_and_forces(back, batch, False)
    assert torch.equal(e2, e1) and torch.equal(f2, f1)
    with pytest.raises(ConfigError, match="forces=direct"):
        load_surrogate(d, quantize_method="int8-dynamic")  # autograd forces: no dynamic kernels


def test_screen_cli_quantize_int8(surrogate, tmp_path):
    from ase.io import write

    from convergent.cli import main

    d, _, recs = surrogate
    from ase import Atoms

    frames = [Atoms(numbers=r["numbers"], positions=r["positions"]) for r in recs]
    xyz = tmp_path / "mols.extxyz"
    write(str(xyz), frames)
    outs = {}
    for q in ("none", "int8"):
        out = tmp_path / f"screen-{q}"
        args = ["screen", "--model", str(d), "--data", str(xyz), "--out", str(out), "-k", "0"]
        assert main(args + ["--quantize", q]) == 0
        outs[q] = [json.loads(line)["energy_pred"] for line in (out / "predictions.jsonl").open()]
    assert main(["screen", "--model", str(d), "--data", str(xyz), "--out", str(tmp_path / "bad"),
                 "--quantize", "int4"]) == 2  # one line naming screen.quantize, nothing written
    assert not (tmp_path / "bad").exists()
    a, b = np.array(outs["none"]), np.array(outs["int8"])
    assert not np.array_equal(a, b)  # it did quantise
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < REL_TOL
