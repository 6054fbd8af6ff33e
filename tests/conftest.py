"""Shared fixtures. Importing moekit on a machine without CUDA turns on TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

import moekit  # noqa: F401  (sets TRITON_INTERPRET before any kernel is defined)

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")
