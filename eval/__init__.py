"""occult_hf.eval."""
