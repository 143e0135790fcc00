"""Test-wide setup.

Triton kernels run in Triton's interpreter when no CUDA device is present, so every kernel is
checked against `kernels/reference.py` in CI. The flag must be set before triton is imported.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def rng_seed() -> int:
    """A fresh seed per test run, printed so a failure can be replayed
    (FREETOKEN_TEST_SEED=<seed> pytest ... runs with that one)."""
    fixed = os.environ.get("FREETOKEN_TEST_SEED")
    seed = int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return seed


# Shared builders live in tests/helpers/. Only that folder goes on sys.path: putting tests/
# itself there would let tests/kernels or tests/engine shadow real packages (transformers probes
# for a `kernels` package). For the same reason the repository root comes off it, where
# `python -m pytest` puts it: our `kernels/` folder would shadow the hub's `kernels`, which
# transformers 5.25 requires and imports (ImportError: cannot import name 'CUDAProperties').
# The package itself is imported from its editable install, whose finder needs no path entry.
_ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != _ROOT]
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Kernel tests use tiny shapes: torch's intra-op thread pool only adds wake-up latency on
    the 2-core CI machine (about 10x slower with it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def poisoned_alloc(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.empty returns NaN-filled (float) / INT_MIN-filled (int) tensors while the test
    runs, so an output element a kernel launcher allocates but never writes fails the test."""
    empty = torch.empty

    def poisoned(*args, **kwargs) -> torch.Tensor:
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -(2**31))

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.fixture(autouse=True)
def _device_left_clean(request):
    """A GPU test starts with the device as a fresh process would have it: the engines of the
    tests before it (cyclic garbage, holding arenas and graph pools) are collected and torch's
    cache emptied. Device-memory tests read mem_get_info; on the device, run after the offload
    tests' twenty-odd engines, two of them saw that garbage instead of their own engine."""
    if "gpu" in request.keywords and torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    yield
