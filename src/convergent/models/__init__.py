"""Models: neighbour lists, the molecular sparse-attention Transformer, Llama."""

