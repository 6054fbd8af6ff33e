"""CPU timing stability: a CPU study measures with one torch intra-op thread by default (--threads),
restores the count after, records it in its rows and says so in its report; the tables show p20–p80
and flag rows whose p80 / p20 > 1.5 as noisy."""

from __future__ import annotations

import math

import pytest
import torch

from moekit.bench import args as arg_types
from moekit.bench import report, sweep
from moekit.bench.ep_report import STUDY as EP
from moekit.bench.imbalance_report import STUDY as IMBALANCE
from moekit.bench.imbalance_report import summary_table
from moekit.bench.results import read_csv, write_csv
from moekit.bench.study import NOISY_RATIO, is_noisy, spread
from moekit.cli import main
from result_rows import imbalance_rows, make_row


@pytest.fixture
def two_threads():
    """The process runs with 2 intra-op threads (restored after the test)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


def test_cpu_threads_sets_and_restores(two_threads):
    with arg_types.cpu_threads(torch.device("cpu"), 1) as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), arg_types.cpu_threads(torch.device("cpu"), 1):
        raise RuntimeError("a failed measurement")
    assert torch.get_num_threads() == 2
    with arg_types.cpu_threads(torch.device("cuda", 0), 1) as n:   # a GPU run: nothing changes
        assert n is None and torch.get_num_threads() == 2


def test_bench_times_with_one_thread_by_default_and_restores(tmp_path, monkeypatch, two_threads):
    seen = []
    real = sweep.run_case

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep, "run_case", spy)
    argv = ["bench", "--preset", "tiny", "--quick", "--tokens", "1,2", "--backends", "loop",
            "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    assert seen == [1, 1] and torch.get_num_threads() == 2
    rows = read_csv(tmp_path / "a" / "results.csv")
    assert [r.threads for r in rows] == [1, 1]
    text = (tmp_path / "a" / "report.md").read_text()
    assert "CPU timing with 1 torch intra-op thread (`--threads`" in text

    seen.clear()
    assert main([*argv, "--threads", "3", "--out", str(tmp_path / "b")]) == 0
    assert seen == [3, 3] and torch.get_num_threads() == 2
    assert {r.threads for r in read_csv(tmp_path / "b" / "results.csv")} == {3}
    assert "with 3 torch intra-op threads" in (tmp_path / "b" / "report.md").read_text()


def test_imbalance_and_ep_bench_record_their_threads(tmp_path, two_threads):
    out = tmp_path / "imb"
    assert main(["imbalance", "--preset", "tiny", "--tokens", "16", "--scenarios", "balanced", "--backends",
                 "loop", "--ep", "2", "--capacity-factors", "1", "--rep", "1", "--warmup", "0",
                 "--out", str(out)]) == 0
    assert {r.threads for r in IMBALANCE.read(out / "results.csv")} == {1} and torch.get_num_threads() == 2
    assert "CPU timing with 1 torch intra-op thread" in (out / "report.md").read_text()
    out = tmp_path / "ep"
    assert main(["ep-bench", "--simulate", "2", "--preset", "tiny", "--tokens", "8", "--scenarios",
                 "balanced", "--rep", "2", "--warmup", "0", "--threads", "2", "--out", str(out)]) == 0
    assert {r.threads for r in EP.read(out / "results.csv")} == {2}
    assert "CPU timing with 2 torch intra-op threads" in (out / "report.md").read_text()


@pytest.mark.parametrize("p20,p80,noisy", [(1.0, 1.5, False), (1.0, 1.51, True), (2.0, 2.1, False),
                                           (math.nan, math.nan, False), (0.0, 1.0, False)])
def test_noisy_is_p80_over_p20_above_one_and_a_half(p20, p80, noisy):
    assert NOISY_RATIO == 1.5
    assert is_noisy(p20, p80) is noisy
    assert spread(p20, p80).endswith(" noisy") is noisy


def test_the_bench_report_shows_the_spread_and_flags_noisy_rows(tmp_path):
    rows = [make_row(tokens=1, backend="loop", median_ms=2.0, p20_ms=1.9, p80_ms=2.2, threads=1),
            make_row(tokens=1, backend="triton", median_ms=2.0, p20_ms=1.0, p80_ms=3.0, threads=1),
            make_row(tokens=4, backend="loop", median_ms=2.0, p20_ms=1.9, p80_ms=2.1, threads=1),
            make_row(tokens=4, backend="triton", status="failed", reason="x", median_ms=math.nan,
                     p20_ms=math.nan, p80_ms=math.nan, n_rep=None, threads=1)]
    text = report.render(rows)
    assert "| 1 | 1.9–2.2 | 1–3 noisy |" in text                      # the p20–p80 table
    assert "| 1 | 0.005 | 2 (0.25%) | 2 (0.25%) noisy |" in text       # the median table flags it too
    assert "1 of 3 timed rows **noisy** (p80 / p20 > 1.5" in text
    assert "CPU timing with 1 torch intra-op thread" in text
    write_csv(rows, tmp_path / "results.csv")                          # and it redraws from the CSV
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").read_text() == text


def test_a_csv_from_before_threads_still_reads(tmp_path):
    rows = [make_row(tokens=t, p20_ms=1.9, p80_ms=2.1) for t in (1, 4)]
    text = "\n".join(",".join(line.split(",")[:-1]) for line in
                     write_csv_text(rows).splitlines()) + "\n"          # the threads column dropped
    (tmp_path / "results.csv").write_text(text)
    read = read_csv(tmp_path / "results.csv")
    assert [r.threads for r in read] == [None, None]
    assert "intra-op thread count was not recorded" in report.render(read)
    assert "none noisy" in report.render(read)


def write_csv_text(rows) -> str:
    from moekit.bench.results import rows_to_csv

    return rows_to_csv(rows)


def test_the_imbalance_tables_show_the_spread():
    from dataclasses import replace

    rows = imbalance_rows()
    rows[0] = replace(rows[0], p20_ms=1.0, p80_ms=4.0)                 # balanced, loop: noisy
    text = IMBALANCE.render(rows, IMBALANCE.legacy[0])["imbalance.md"]
    assert "| balanced | 1.00 | 0.01 | 2 (0%), 1–4 noisy | 1 (1%), 1–1 |" in text
    assert "1 of 4 timed rows **noisy**" in text
    table = summary_table(rows)
    assert "2 noisy" in list(table.columns[2].cells)
