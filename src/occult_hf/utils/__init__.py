"""Small helpers every layer may use: input checks, atomic writes, logging, CUDA-graph capture."""
