"""Shared test setup."""

import torch

# One thread: the tiny models' ops are too small to split, and busy-waiting worker threads make
# every op many times slower when other jobs share the machine's two cores.
torch.set_num_threads(1)
