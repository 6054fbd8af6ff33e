"""scripts/dram_traffic.py --report: ncu's CSV (a unit a row, picked by ncu) into the per-kernel table."""

from __future__ import annotations

from helpers import load_script

METRICS = [  # (id, kernel, metric, unit, value as ncu prints it)
    ("0", "align_hist_kernel", "dram__bytes_read.sum", "Kbyte", "112.90"),
    ("0", "align_hist_kernel", "dram__bytes_write.sum", "byte", "0"),
    ("0", "align_hist_kernel", "gpu__time_duration.sum", "ns", "3,136"),
    ("0", "align_hist_kernel", "lts__t_sector_hit_rate.pct", "%", "92.80"),
    ("1", "moe_gemm1_swiglu_kernel(int, int)", "dram__bytes_read.sum", "byte", "857,700,000"),
    ("1", "moe_gemm1_swiglu_kernel(int, int)", "dram__bytes_write.sum", "Mbyte", "30.40"),
    ("1", "moe_gemm1_swiglu_kernel(int, int)", "gpu__time_duration.sum", "us", "258.50"),
    ("1", "moe_gemm1_swiglu_kernel(int, int)", "lts__t_sector_hit_rate.pct", "%", "34.10"),
]


def test_report_reads_each_row_unit(tmp_path):
    lines = ["==PROF== Connected to process 1",
             '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"',
             *(",".join(f'"{v}"' for v in row) for row in METRICS)]
    path = tmp_path / "ncu.csv"
    path.write_text("\n".join(lines) + "\n")
    text = load_script("dram_traffic").report(str(path), "qwen3-30b-a3b", [2048])
    rows = [line for line in text.splitlines() if line.startswith(("| 0 ", "| 1 "))]
    assert rows == ["| 0 | `align_hist_kernel` | 3.1 | 0.1 | 0.0 | 92.8 |",          # ns, Kbyte
                    "| 1 | `moe_gemm1_swiglu_kernel` | 258.5 | 857.7 | 30.4 | 34.1 |"]  # us, byte, Mbyte
    assert "weights 1208 MB" in text
