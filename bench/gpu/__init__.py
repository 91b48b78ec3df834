"""On one CUDA GPU: ours fp32 and bf16 against the transformers / plain-PyTorch baselines
(:mod:`bench.gpu.throughput`), where the GPU time goes (:mod:`bench.gpu.profile`), and
retrospective active learning's gpu preset (:mod:`bench.gpu.al`)."""
