"""Studies: commands that measure occult_hf on real routing data and print the tables the docs quote."""
