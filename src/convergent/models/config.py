"""Config of the molecular surrogate (``model`` section).

Distances in Å, energies in eV. Every default works on a 2-core laptop.
``model.kind`` picks the network: ``molecular`` (the sparse-attention Transformer of
:mod:`convergent.models.molecular`), ``mace`` (mace-torch's MACE,
:mod:`convergent.models.mace`, hyper-parameters in ``model.mace``; optional extra
``convergent[mace]``), ``schnet`` / ``painn`` (schnetpack's SchNet / PaiNN,
:mod:`convergent.models.schnetpack`, sized by ``hidden``, ``layers``, ``num_rbf`` and
``cutoff``; optional extra ``convergent[schnetpack]``) or ``llama`` (the language model of
the LM tasks).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from convergent.core.configbase import Count, Count0, Positive, Section


class MaceConfig(Section):
    """MACE hyper-parameters (``model.kind: mace``): mace-torch's ``ScaleShiftMACE``.

    The defaults are the "small" MACE of the molecular benches (mace_run_train's settings
    except the width): ``r_max`` 5 Å, 2 interactions, hidden irreps ``32x0e+32x1o``
    (``channels`` per l up to ``max_L``), spherical harmonics to ``max_ell`` 3, body order
    ``correlation`` 3, 8 Bessel functions with a p=5 polynomial cutoff, a 64x64x64 radial
    MLP and a 16-wide readout MLP. ``dtype``: the network's floating type (MACE recommends
    float64 for MD; the element reference energies and the energy sums are float64 either
    way).
    """

    r_max: float = Field(5.0, gt=0.0, le=12.0)  # Å: the neighbour cutoff
    num_interactions: int = Field(2, ge=1, le=6)  # message-passing layers
    channels: int = Field(32, ge=1, le=512)  # channels per l of the hidden irreps
    max_L: int = Field(1, ge=0, le=3)  # highest l of the hidden irreps (1: 32x0e+32x1o)
    max_ell: int = Field(3, ge=1, le=6)  # highest l of the edge spherical harmonics
    correlation: int = Field(3, ge=1, le=4)  # body order of the product basis
    num_radial_basis: int = Field(8, ge=1, le=64)  # Bessel functions of the distance
    num_polynomial_cutoff: int = Field(5, ge=1, le=12)  # p of the polynomial envelope
    radial_mlp: list[Annotated[int, Field(ge=1, le=1024)]] = Field(
        default_factory=lambda: [64, 64, 64], min_length=1, max_length=6)
    readout_mlp: int = Field(16, ge=1, le=512)  # width of the last layer's readout MLP
    dtype: Literal["float32", "float64"] = "float32"

    @property
    def hidden_irreps(self) -> str:
        """``channels`` x every l to ``max_L`` with the parity of a polar vector:
        ``32x0e+32x1o`` for the defaults (as mace_run_train's num_channels and max_L)."""
        return "+".join(f"{self.channels}x{ell}{'eo'[ell % 2]}" for ell in range(self.max_L + 1))


class ModelConfig(Section):
    """Sparse-attention molecular Transformer hyper-parameters (distances in Å).

    ``attention``: ``neighbor`` (default) attends only over the cutoff graph built by a
    cell list, O(N·k); ``topk`` scores every atom pair of a structure and keeps the
    ``topk`` best per atom (the O(N²) reference recipe); ``dense`` attends over every
    atom pair of a structure (O(N²)). ``max_neighbors`` caps the neighbours per atom;
    what happens when an atom has more is set by ``neighbor_overflow``: ``error``
    (default, never silent) or ``drop`` (keep the nearest, log and count the dropped
    pairs). ``keep_fp32`` lists sub-module name patterns (fnmatch) run in fp32 under
    bf16/fp16 autocast; the per-molecule energy sum is always fp32/fp64. ``forces``:
    ``autograd`` (default, conservative: ``F = -dE/dpositions``) or ``direct`` (a force
    head on the final atom features, :mod:`convergent.models.direct_forces`: no double
    backward, so it also trains with ``parallel.strategy: pipeline``; not conservative).
    """

    kind: Literal["molecular", "mace", "schnet", "painn", "llama"] = "molecular"
    # kind=mace: MACE's own hyper-parameters (hidden/layers/heads/attention/cutoff and the
    # other Transformer fields below do not apply to it; max_z, max_neighbors,
    # neighbor_overflow, repulsion and repulsion_scale do)
    mace: MaceConfig = MaceConfig()
    hidden: Count = 64
    layers: Count = 3
    heads: Count = 4
    cutoff: Positive = 5.0  # Å
    max_neighbors: Count | None = None
    neighbor_overflow: Literal["error", "drop"] = "error"
    attention: Literal["neighbor", "topk", "dense"] = "neighbor"
    # silu (default): gated sum over neighbours (grows with the neighbour count, as an
    # extensive energy does); softmax: weighted mean (with a sink slot). On fold 0 of
    # bench/models/accuracy.py's 544 NCI compounds, silu: 0.35 eV, softmax: 0.47 eV
    # energy MAE on unseen compounds. See EdgeAttentionBlock._weights (edge_attention.py).
    attention_weights: Literal["softmax", "silu"] = "silu"
    # LayerNorm at the input of the per-atom energy head. Off by default: it discards the
    # magnitude of the atom features (same fold: 0.30-0.32 eV without it, 0.35 with it).
    # Checkpoints saved before this field existed load with it on (models.io).
    head_norm: bool = False
    # a vector channel per atom (convergent.models.vector_attention): bond angles enter
    # through inner products of bond directions; the energy stays invariant. Needs
    # edge_chunk=0 (the vector block runs all edges in one pass).
    vectors: bool = False
    topk: Count = 32  # neighbours kept per atom by attention="topk"
    num_rbf: Count = 32  # radial basis functions on [0, cutoff]
    max_z: int = Field(94, ge=1, le=255)  # largest atomic number the embedding accepts
    mlp_ratio: Count = 2  # feed-forward width = mlp_ratio * hidden
    keep_fp32: list[str] = ["energy_head"]
    forces: Literal["autograd", "direct"] = "autograd"  # how forces are predicted
    # the ZBL repulsive pair prior added to the learned energy (convergent.models.repulsion),
    # enveloped to zero at repulsion_scale x the sum of the two covalent radii. "none": the
    # network alone (checkpoints saved before the prior existed load as "none").
    repulsion: Literal["zbl", "none"] = "zbl"
    repulsion_scale: float = Field(1.0, gt=0.0, le=3.0)
    # Edges per chunk in attention (0 = all at once). Chunking bounds forward temporaries
    # but adds an O(N) gradient buffer per chunk in backward: superlinear at large N.
    edge_chunk: Count0 = 0
    # The attention's message step (convergent.models.edge_kernel): auto = a fused Triton
    # kernel on CUDA where it runs, else torch segment sums over centre-sorted edges;
    # index = the earlier index_add_ scatter (the reference). Scalar blocks without
    # edge_chunk or topk only (the others scatter with index_add_).
    edge_kernel: Literal["auto", "torch", "triton", "index"] = "auto"

    @field_validator("heads")
    @classmethod
    def _heads_divide_hidden(cls, v: int, info: ValidationInfo) -> int:
        hidden = info.data.get("hidden")
        if hidden and hidden % v:
            raise ValueError(f"must divide model.hidden ({hidden})")
        return v

    @field_validator("forces")
    @classmethod
    def _mace_forces_by_autograd(cls, v: str, info: ValidationInfo) -> str:
        kind = info.data.get("kind")
        if v == "direct" and kind in ("mace", "schnet", "painn"):
            raise ValueError(f"must be autograd with model.kind={kind} (its forces are -dE/dx)")
        return v

    @field_validator("edge_chunk")
    @classmethod
    def _one_pass_with_vectors(cls, v: int, info: ValidationInfo) -> int:
        if v and info.data.get("vectors"):
            raise ValueError("must be 0 with model.vectors: true (the vector block runs all edges in one pass)")
        return v

    @field_validator("edge_kernel")
    @classmethod
    def _triton_scalar_neighbour_blocks(cls, v: str, info: ValidationInfo) -> str:
        d = info.data
        if v == "triton" and (d.get("vectors") or d.get("edge_chunk") or d.get("attention") == "topk"):
            raise ValueError("triton needs model.vectors false, model.edge_chunk 0 and "
                             "model.attention neighbor or dense")
        return v

    @property
    def state_width(self) -> int:
        """Width of the per-atom state passed between blocks (and pipeline stages):
        ``hidden`` scalars, plus ``3·hidden`` vector components with ``vectors``."""
        return self.hidden * (4 if self.vectors else 1)
