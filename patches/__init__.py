"""occult_hf.patches."""
