"""The molecular models against their peers: accuracy at an equal budget
(:mod:`bench.models.accuracy`), MD stability (:mod:`bench.models.md_stability`), cost per
structure against xTB and DFT (:mod:`bench.models.cost`), time and memory against atom count
(:mod:`bench.models.scaling`), transfer learning (:mod:`bench.models.transfer`) and
neighbour lists (:mod:`bench.models.neighbors`). Their shared pieces: datasets and evaluation
(:mod:`bench.models.molbench`), the sides — ours, SchNet, PaiNN and MACE as model kinds
trained by the one training loop (:mod:`bench.models.molbench_sides`), the MD criteria
(:mod:`bench.models.molbench_md`) and the nci2k dataset (:mod:`bench.models.nci2k`)."""
