"""The demo run by ``python -m jax_threadmap``: not part of the library."""
