"""Profiling, solving, comparison and the CLI: the composition root of mmplan."""
