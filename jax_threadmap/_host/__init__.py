"""The maps wing on the host: flat maps over views, their callers and generated
loops, summed outputs, chunks packed for other processes."""
