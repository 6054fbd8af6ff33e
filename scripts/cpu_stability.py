"""Do two consecutive CPU runs of `moekit bench` agree? Their medians, row by row.

    python scripts/cpu_stability.py [--trials 5] [--backend loop] [--tokens 1,4,16] [--rep 61]
                                    [--threads 1] [--tolerance 0.25] [--keep DIR] [--readme]

--readme runs the README's command as written, `moekit bench` with nothing else (every default
backend and token count, default repeats), and compares all its rows.

Each trial runs `python -m moekit bench --preset tiny --device cpu` twice, one run right after the
other, each in a fresh process (as a user would), and compares every row's median: the larger over
the smaller must stay within 1 + tolerance. Prints one line per trial (the ratio of each token
count, the machine's load average) and a summary; exits 1 when any row of any trial is off by more.

Why a script and not a test of the suite: on a shared machine the load moves between two runs
(other jobs start and stop), and a load shift moves every row of the second run together; the
comparison then measures the machine, not moekit. With one intra-op thread (the default) the rows
of one run agree closely; with two threads on two busy cores a median moves by 10-500x between
runs (threads waiting for a core), which is what `--threads 1` removes. Run it on a quiet machine,
or with MOEKIT_STABILITY=1 the suite runs one trial (tests/test_cpu_threads.py).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def command(args: argparse.Namespace) -> list[str]:
    """The `moekit bench` arguments of one run (without --out)."""
    if args.readme:
        return ["bench"]
    return ["bench", "--preset", "tiny", "--device", "cpu", "--backends", args.backend, "--tokens",
            args.tokens, "--rep", str(args.rep), "--warmup", "3", "--threads", str(args.threads)]


def bench(out: Path, args: argparse.Namespace) -> dict[str, float]:
    """One run of `moekit bench` in a fresh process; {row: median ms}, row = "backend mode T=tokens"."""
    cmd = [sys.executable, "-m", "moekit", *command(args), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(SRC)}   # this tree's moekit, installed or not
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode != 0:
        sys.exit(f"cpu_stability: `{' '.join(cmd)}` failed:\n{done.stdout}{done.stderr}")
    with open(out / "results.csv", newline="") as f:
        return {f"{r['backend']} {r['mode']} T={r['tokens']}": float(r["median_ms"])
                for r in csv.DictReader(f) if r["status"] == "ok"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--backend", default="loop")
    p.add_argument("--tokens", default="1,4,16")
    p.add_argument("--rep", type=int, default=61, help="timed calls per case (default 61)")
    p.add_argument("--threads", type=int, default=1, help="moekit bench --threads (default 1)")
    p.add_argument("--tolerance", type=float, default=0.25)
    p.add_argument("--keep", type=Path, default=None, help="keep the runs' folders here")
    p.add_argument("--readme", action="store_true", help="run `moekit bench` as the README gives it")
    args = p.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="moekit-stability-"))
    print(f"moekit {' '.join(command(args))}; {os.cpu_count()} cores; two runs per trial")
    worst_all = []
    for trial in range(args.trials):
        a = bench(root / f"trial{trial}-a", args)
        b = bench(root / f"trial{trial}-b", args)
        ratios = {t: max(a[t], b[t]) / min(a[t], b[t]) for t in a if t in b}
        missing = sorted(set(a) ^ set(b))
        worst = max(ratios.values()) if ratios and not missing else float("inf")
        worst_all.append(worst)
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        shown = sorted(ratios.items(), key=lambda kv: -kv[1])[:4] if args.readme else ratios.items()
        print(f"trial {trial}: " + (f"{len(ratios)} rows, the worst: " if args.readme else "")
              + ", ".join(f"{t} {a[t]:.3g}/{b[t]:.3g} ms ({r:.2f}x)" for t, r in shown)
              + (f"; untimed in one run: {missing}" if missing else "") + f"; load {load}", flush=True)
    bad = sum(w > 1 + args.tolerance for w in worst_all)
    print(f"{args.trials - bad} of {args.trials} trials within {1 + args.tolerance:.2f}x on every row "
          f"(worst ratio per trial: {', '.join(f'{w:.2f}' for w in worst_all)})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
