"""scripts/kernel_breakdown.py on the CPU: the tables are written, every backend row is accounted for,
and a backend without a backward on the device is reported as not run, not silently dropped."""

from __future__ import annotations

import pytest
import torch

from helpers import load_script


def _script():
    return load_script("kernel_breakdown")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the script")
def test_breakdown_tables_on_cpu(tmp_path, capsys):
    out = tmp_path / "b.md"
    args = ["--backward", "--tokens", "5", "--backends", "loop,grouped_mm", "--out", str(out)]
    assert _script().main(args) == 0
    text = out.read_text()
    assert text.strip() == capsys.readouterr().out.strip()
    assert "## loop, T = 5: wall" in text and "| kernel | count | ms | share |" in text
    assert "## grouped_mm, T = 5: not run" in text      # no backward on the CPU: said, not skipped silently
    shares = [int(line.rsplit("|", 2)[-2].strip().rstrip("%")) for line in text.splitlines()
              if line.startswith("| `aten::") or " others |" in line]
    assert shares and 97 <= sum(shares) <= 103          # rounded shares of the whole


def test_breakdown_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        _script().main(["--tokens", "0"])
    assert exc.value.code == 2 and "--tokens" in capsys.readouterr().err
