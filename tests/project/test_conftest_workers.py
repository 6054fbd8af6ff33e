"""tests/conftest.py's `pytest_cmdline_main`: a plain `pytest` without CUDA runs on two xdist workers,
one test file a worker; anything else (CUDA, paths named, -n given, --pdb, a worker's own
configuration, no xdist, --collect-only, $MOEKIT_TEST_WORKERS 0 or 1) leaves the run as it is."""

from __future__ import annotations

import types

import pytest

import conftest


def fake_config(*, numprocesses=None, source=pytest.Config.ArgsSource.TESTPATHS, usepdb=False, xdist=True,
                collectonly=False, worker=False):
    cfg = types.SimpleNamespace(
        option=types.SimpleNamespace(numprocesses=numprocesses, dist="no", collectonly=collectonly),
        args_source=source,
        pluginmanager=types.SimpleNamespace(hasplugin=lambda name: xdist and name == "xdist"),
        getoption=lambda name, default=None: usepdb if name == "usepdb" else default,
    )
    if worker:
        cfg.workerinput = {}
    return cfg


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(conftest, "HAS_CUDA", False)
    monkeypatch.setattr(conftest.os, "cpu_count", lambda: 2)
    monkeypatch.delenv(conftest.TEST_WORKERS_ENV, raising=False)


def test_a_plain_run_without_cuda_takes_two_workers_a_file_each(cpu_only):
    cfg = fake_config()
    assert conftest.pytest_cmdline_main(cfg) is None          # the hook chain goes on (xdist's own)
    assert (cfg.option.numprocesses, cfg.option.dist) == (2, "loadfile")


def test_one_cpu_runs_in_one_process(cpu_only, monkeypatch):
    monkeypatch.setattr(conftest.os, "cpu_count", lambda: 1)
    cfg = fake_config()
    conftest.pytest_cmdline_main(cfg)
    assert (cfg.option.numprocesses, cfg.option.dist) == (None, "no")


@pytest.mark.parametrize("value, want", [("3", 3), ("0", None), ("1", None), (" 4 ", 4)])
def test_the_environment_sets_the_count(cpu_only, monkeypatch, value, want):
    monkeypatch.setenv(conftest.TEST_WORKERS_ENV, value)
    cfg = fake_config()
    conftest.pytest_cmdline_main(cfg)
    assert cfg.option.numprocesses == want


def test_a_bad_count_is_a_usage_error(cpu_only, monkeypatch):
    monkeypatch.setenv(conftest.TEST_WORKERS_ENV, "two")
    with pytest.raises(pytest.UsageError, match=r"\$MOEKIT_TEST_WORKERS must be an integer, got 'two'"):
        conftest.pytest_cmdline_main(fake_config())


@pytest.mark.parametrize("case", ["cuda", "paths", "n-given", "n-zero", "pdb", "no-xdist", "worker",
                                  "collect"])
def test_everything_else_is_left_alone(cpu_only, monkeypatch, case):
    kwargs = {"paths": dict(source=pytest.Config.ArgsSource.ARGS), "n-given": dict(numprocesses=3),
              "n-zero": dict(numprocesses=0), "pdb": dict(usepdb=True), "no-xdist": dict(xdist=False),
              "worker": dict(worker=True), "collect": dict(collectonly=True)}.get(case, {})
    if case == "cuda":
        monkeypatch.setattr(conftest, "HAS_CUDA", True)
    cfg = fake_config(**kwargs)
    before = (cfg.option.numprocesses, cfg.option.dist)
    conftest.pytest_cmdline_main(cfg)
    assert (cfg.option.numprocesses, cfg.option.dist) == before
