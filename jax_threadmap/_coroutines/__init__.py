"""The coroutines wing: ``async def`` support for both wings. The package's one
event loop (loaders of ``async_call`` and ``async def`` kernels run on it),
``jax_threadmap.shared`` resources opened on it, and ``async def`` kernels' maps."""
