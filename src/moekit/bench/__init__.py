"""The lab: every `moekit` study, on one scaffold. It imports the runtime; the runtime never imports it.

The scaffold (every study: arguments -> measure -> rows -> results.csv -> report.md + plots)
    args.py             shared flags, argument types, machine-dependent defaults; exit statuses
    study.py            Study, the one write step and report step, `moekit report` detection
    results.py          Provenance, the long-format row writer / reader, atomic files
    timing.py           time_fn / TimingStats, capture_graph (the one CUDA-graph capture), sync
    report_cli.py       `moekit report DIR`: redraw any study's folder

Measuring
    ceilings.py         measured copy bandwidth and matmul rate of the device (the roofs)
    roofline.py         bytes, FLOPs and the floor of one call; the compute-bound crossover
    correctness.py      the gate every backend passes before it is timed
    launches.py         kernels per call and device busy time (torch.profiler)
    peers.py            Transformers' experts implementations, sharing moekit's weights
    dense.py            the dense pair: the layer's FLOPs as two dense matmuls through one expert
    kernel_work.py      the triton kernels' useful FLOPs and the rows their tiles compute (padding)
    runner.py           the contract: (shape, tokens, backend, mode) -> Measurement
    scenarios.py        routing scenarios: balanced, random router, zipf, hot, collapse, traces
    simulate.py         expert parallelism on one device: simulate_ep, rank_problem, StepTime

The studies (the subcommand, then its rows and report step)
    cli.py, sweep.py    `moekit bench`          report.py, plots.py   ResultRow's report and plots
    backward.py         `moekit bench --backward`: one forward + backward per call, its gate and memory
    imbalance.py        `moekit imbalance`      imbalance_report.py   ImbalanceRow, report, plots
    ep_bench.py         `moekit ep-bench`       ep_report.py          EPRow, report, plot
    tune.py             `moekit tune`           tune_report.py        TuneRow, report, plot
    ablate.py           `moekit ablate`         ablate_report.py      AblateRow, the catalogue, report
    ablate_variants.py  the variants it times   ablate_plots.py       one figure per ablation
    ablate_bytes.py     Nsight Compute DRAM bytes (a child process under ncu)
    profile.py          `moekit profile`        ProfileRow, report (kernels, host work, graph launch)
    variants.py         `moekit sweep`          SweepRow, report (the sets of variants side by side)
    wgrad.py            the weight-gradient candidates and one T's case (`moekit sweep --set wgrad`)
    e2e.py              `moekit e2e`            E2ERow, report, the Transformers models' sizes
    lab.py              what those three share: the run, the report's head and tables

Only the light modules are imported here; plotting pulls in matplotlib when it is used. The lab
imports `moekit.kernels` first: on a machine without CUDA it switches Triton to its interpreter,
which must happen before anything imports triton (Triton's own @jit helpers are made at its import).
"""

import moekit.kernels  # noqa: F401  (first: TRITON_INTERPRET before triton is imported)
from moekit.bench.ceilings import Ceilings, measure_ceilings
from moekit.bench.roofline import Traffic, crossover_tokens, floor_ms, traffic
from moekit.bench.timing import NotCapturable, TimingStats, time_fn

__all__ = [
    "Ceilings",
    "NotCapturable",
    "TimingStats",
    "Traffic",
    "crossover_tokens",
    "floor_ms",
    "measure_ceilings",
    "time_fn",
    "traffic",
]
