"""The async wing: arrays whose values a background call fills (calls, their pool,
dispatch, sharded loads; ``async def`` loaders run on ``_coroutines``' loop)."""
