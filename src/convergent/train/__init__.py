"""Training engine: strategies, precision, compression, checkpoints, launch."""

