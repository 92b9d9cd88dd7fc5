"""The native engine's CPU floating-point mode: subnormal floats flushed to zero on every thread."""

import pytest
import torch

from batchgen.engine import cpu


def test_subnormals_are_flushed_on_every_openmp_thread():
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: no OpenMP worker to check")
    x = torch.full((1 << 20,), 1e-39)  # subnormal fp32; large enough that ATen splits it across threads
    if not cpu.set_flush_denormal_everywhere(False):
        pytest.skip("no flush-to-zero mode on this CPU, or another OpenMP runtime")
    try:
        assert bool(((x * 0.5) > 0).all())  # kept: the test can see the difference
        torch.set_flush_denormal(True)  # the calling thread only: the workers' shares stay subnormal
        assert not bool(((x * 0.5) == 0).all())
        assert cpu.set_flush_denormal_everywhere(True)
        assert bool(((x * 0.5) == 0).all())  # every thread's share
    finally:
        cpu.set_flush_denormal_everywhere(True)  # as an engine built in this process leaves it
