"""Training: throughput against plain PyTorch DDP, Lightning Fabric and Accelerate
(:mod:`bench.train.throughput`), DDP gradient compression (:mod:`bench.train.compression`),
pipeline parallelism for the molecular surrogate (:mod:`bench.train.pipeline_molecular`) and
topology-aware collectives on an emulated two-node network (:mod:`bench.train.collectives`,
its ranks :mod:`bench.train.collectives_worker`, the network :mod:`bench.train.netemu`, the
projection :mod:`bench.train.collectives_projection`)."""
