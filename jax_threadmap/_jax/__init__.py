"""The one home of JAX internals: the hook table."""
