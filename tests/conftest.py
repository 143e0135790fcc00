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
    """A fresh seed per test run, printed so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return seed


# Shared builders (tiny_models.py) live beside this file; importlib mode does not put the
# tests folder on sys.path by itself.
sys.path.insert(0, os.path.dirname(__file__))
