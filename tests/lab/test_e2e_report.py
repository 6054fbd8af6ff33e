"""`moekit e2e`'s report names what it measured: on a CPU the model is the tiny stand-in of the
published config (its sizes in the rows and the section titles) and the report says once that it is
a CPU run; `moekit report` redraws the same text from the CSV alone; rows of the published sizes
(a GPU run, or a CSV written before the stand-in column) read as before."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest

from helpers import run_cli
from moekit.bench import e2e
from moekit.bench.results import rows_to_csv
from moekit.bench.study import CSV_NAME, REPORT_NAME

STAND_IN = "qwen3_moe (tiny stand-in: hidden 64, 8 experts)"


def test_a_cpu_run_names_the_tiny_stand_in_and_says_it_ran_on_the_cpu(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "e"
    assert run_cli(["e2e", "--what", "prefill", "--impls", "grouped_mm,moekit", "--prompt", "4",
                    "--out", str(out)]) == 0
    report = (out / REPORT_NAME).read_text()
    assert f"## prefill: {STAND_IN}, 1 layers, 4 tokens" in report
    assert "## prefill: qwen3_moe, " not in report
    cpu = [line for line in report.splitlines() if line.startswith("> CPU run: ")]
    assert len(cpu) == 1 and "tiny stand-in" in cpu[0] and "not a measurement" in cpu[0]
    rows = e2e.STUDY.read(out / CSV_NAME)
    assert {(r.model, r.model_note) for r in rows} == {("qwen3_moe", "tiny stand-in: hidden 64, 8 experts")}
    (out / REPORT_NAME).unlink()
    assert run_cli(["report", str(out)]) == 0                     # from the CSV alone: the same text
    assert (out / REPORT_NAME).read_text() == report


def _gpu_row(**kw) -> e2e.E2ERow:
    base = dict(run_id="20261202T153059Z", date="2026-12-02T15:30:59+00:00", commit="c748c86",
                device_type="cuda", device_name="NVIDIA H200", torch_version="2.11.0+cu130",
                triton_version="3.6.0", transformers_version="5.17.0", python_version="3.12.3",
                moekit_version="0.1.0", dtype="bfloat16", copy_gbps=4073.0, matmul_tflops=684.0,
                model="qwen3_moe", layers=8, tokens=4096, impl="grouped_mm", what="prefill", status="ok",
                reason="", median_ms=28.9, p20_ms=28.3, p80_ms=29.4, n_rep=9, speedup=1.0,
                tokens_match=None)
    base.update(kw)
    return e2e.E2ERow(**base)


def test_rows_of_the_published_sizes_read_as_before_even_from_a_csv_without_the_column(tmp_path):
    rows = [_gpu_row(), _gpu_row(impl="moekit", median_ms=25.5, speedup=28.9 / 25.5)]
    old = [f.name for f in fields(e2e.E2ERow) if f.name != "model_note"]    # a CSV from before the column
    text = rows_to_csv(rows, e2e.E2ERow).splitlines()
    keep = [text[0].split(",").index(c) for c in old]
    (tmp_path / CSV_NAME).write_text("\n".join(",".join(line.split(",")[i] for i in keep) for line in text)
                                     + "\n")
    read = e2e.STUDY.read(tmp_path / CSV_NAME)
    assert [r.model_note for r in read] == ["", ""] and not math.isnan(read[1].speedup)
    for report in (e2e.render(rows)[REPORT_NAME], e2e.render(read)[REPORT_NAME]):
        assert "## prefill: qwen3_moe, 8 layers, 4096 tokens" in report
        assert "stand-in" not in report and "CPU run" not in report
