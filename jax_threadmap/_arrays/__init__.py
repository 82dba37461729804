"""The async wing: arrays whose values a background call fills (calls, their pool
and event loop, dispatch, sharded loads)."""
