"""Prompt sources: the generated arithmetic task (tiny default) and math datasets (paper runs)."""
