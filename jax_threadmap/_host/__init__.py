"""The maps wing on the host: the batch spec, flat maps over views, their callers
and generated loops, summed outputs, chunks packed for other processes."""
