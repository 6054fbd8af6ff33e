"""Shared fixtures. Importing moekit.kernels on a machine without CUDA turns on TRITON_INTERPRET=1."""

from __future__ import annotations

import os
import random
import zlib

import numpy as np
import pytest
import torch

import moekit.kernels  # noqa: F401  (sets TRITON_INTERPRET before any kernel is defined)

HAS_CUDA = torch.cuda.is_available()
TEST_WORKERS_ENV = "MOEKIT_TEST_WORKERS"    # worker processes of a plain `pytest` without CUDA; 0: none


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """A plain `pytest` (no paths, no -n) on a machine without CUDA runs on min(2, CPUs) worker processes
    (pytest-xdist), each test file kept on one worker (`--dist loadfile`: a module's fixtures, such as
    the gloo worlds, start once). The interpreted kernels make the suite CPU-bound, so two cores halve
    its time. $MOEKIT_TEST_WORKERS sets the count (0: one process, as without xdist). With CUDA, a path
    or -n given, under --pdb or without xdist, nothing changes."""
    if HAS_CUDA or hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return
    if config.option.numprocesses is not None or config.getoption("usepdb", False):
        return
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS or config.option.collectonly:
        return
    text = os.environ.get(TEST_WORKERS_ENV, "").strip()
    try:
        workers = int(text) if text else min(2, os.cpu_count() or 1)
    except ValueError:
        raise pytest.UsageError(f"${TEST_WORKERS_ENV} must be an integer, got {text!r}") from None
    if workers > 1:
        config.option.numprocesses = workers
        config.option.dist = "loadfile"


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


@pytest.fixture(autouse=True)
def seed_per_test(request) -> int:
    """Seed torch (CPU and CUDA), NumPy and random from the test's node id, before every test.

    The seed is a stable hash of the id (CRC-32, not Python's salted hash()), so a test draws the
    same inputs whether it runs alone, in a subset or in the whole suite, on any machine. The id's
    file is named as if it sat at the top of tests/ ("tests/test_align.py::test_..."): a file moved
    between the folders under tests/ keeps its inputs (test file names are unique across the tree).
    """
    path, _, test = request.node.nodeid.partition("::")
    seed = zlib.crc32(f"tests/{path.rsplit('/', 1)[-1]}::{test}".encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return seed


@pytest.fixture
def descriptors(monkeypatch):
    """The block shapes of the TMA descriptors the grouped GEMM launchers build, in order: proof
    that the descriptor path ran (`ExpertsConfig.tma_weights`)."""
    import moekit.grouped_gemm as gg

    made = []

    def spy(*args, **kwargs):
        made.append(args[3])                               # block shape
        return real(*args, **kwargs)

    real = gg.TensorDescriptor
    monkeypatch.setattr(gg, "TensorDescriptor", spy)
    return made


@pytest.fixture(scope="module")
def qwen_layer():
    """Qwen3-30B-A3B's layer in bf16 on the GPU, seeded, for inference (the GPU tests' shared layer)."""
    from moekit import PRESETS, MoELayer

    torch.manual_seed(0)
    return MoELayer(PRESETS["qwen3-30b-a3b"], dtype=torch.bfloat16, device="cuda").requires_grad_(False)


@pytest.fixture
def on_hopper(monkeypatch):
    """The Hopper Gluon kernels' dispatch predicates as on an H200 with Gluon, for CPU tensors (the
    device check is `moekit.grouped_gemm.backward._sm90`); their switches and Triton tiles unset."""
    import moekit.grouped_gemm.backward as gb
    from moekit.grouped_gemm import gluon_wgrad
    from moekit.tuning import WGRAD_ENV

    monkeypatch.setattr(gluon_wgrad, "GLUON_AVAILABLE", True)
    monkeypatch.setattr(gb, "_sm90", lambda device: True)
    for env in (gb.GLUON_WGRAD_ENV, gb.GLUON_SWIGLU_ENV, WGRAD_ENV):
        monkeypatch.delenv(env, raising=False)
