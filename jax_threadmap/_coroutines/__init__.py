"""The coroutines wing: the event loop that ``async def`` loaders and kernels run
on, the resources shared on it (``jax_threadmap.shared``), ``async def`` maps."""
