"""Benchmarks behind `occult bench <name>` (one module per benchmark; see `occult_hf.cli.bench`)."""
