import os

import pytest
import torch

# Deterministic, small thread count: the test machine has 2 cores and tests compare numbers exactly.
THREADS = max(1, min(2, os.cpu_count() or 1))
torch.set_num_threads(THREADS)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
    # a script's main() under test sets the process's threads (--threads); the next test gets THREADS again, or its
    # in-process figures would be summed differently from a child process's
    torch.set_num_threads(THREADS)
