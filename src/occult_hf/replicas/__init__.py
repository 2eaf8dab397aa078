"""Replicated experts at run time: the rule that sends each (token, expert) pair to one of the expert's homes.

- `routing`: the rule itself in torch and NumPy (static and load-aware choices, pin slack, the home tables), used by
  the dispatchers, the metrics and the planners alike;
- its per-expert and per-pair halves as Triton kernels (what the dispatchers launch on a GPU), bit for bit the torch
  version's integers, live with the other kernels: `occult_hf.kernels.replica_routes`, `occult_hf.kernels.replica_pairs`.

This `__init__` imports nothing, so `occult_hf.replicas.routing` does not pull in Triton.
"""
