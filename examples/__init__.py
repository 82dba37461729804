"""Worked examples of jax_threadmap (run them from the repository root)."""
