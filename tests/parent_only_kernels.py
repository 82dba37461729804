"""A kernel module that imports in the test process but not in a worker process
(as a module installed where the workers' Python cannot see it)."""

import multiprocessing

import numpy as np

if multiprocessing.parent_process() is not None:
    import a_module_the_workers_lack  # noqa: F401


def double(x):
    return x * np.float32(2)
