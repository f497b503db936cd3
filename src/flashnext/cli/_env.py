"""Process settings the command line makes before torch loads (imported first by `flashnext.cli`).

OpenMP threads that wait for work spin on their core for a while by default. On a box other jobs also use, a
spinning thread holds a core another process needs, and a parallel region waits for the thread the scheduler left
out: the tiny SFT recipe took 1.3 s a step with one thread and 2.4 s with two spinning threads beside two busy
processes, but 0.6 s with two threads that sleep while they wait (`benchmarks/threads_under_load.py`). So every
command defaults to `OMP_WAIT_POLICY=PASSIVE`; a value already in the environment wins (`OMP_WAIT_POLICY=ACTIVE` for a
dedicated box). OpenMP reads it once, when torch loads, so it is set here, before anything imports torch.
"""

import os

WAIT_POLICY = "OMP_WAIT_POLICY"

os.environ.setdefault(WAIT_POLICY, "PASSIVE")
