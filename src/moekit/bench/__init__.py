"""The benchmark lab: time every backend against the roofline floor (`moekit bench`).

    timing.py       time_fn / TimingStats: per-call times, cache flushed, CUDA graphs
    ceilings.py     measured copy bandwidth and matmul rate of the device (the roofs)
    roofline.py     bytes, FLOPs and the floor of one call; the compute-bound crossover
    correctness.py  the gate every backend passes before it is timed
    launches.py     kernels per call and device busy time (torch.profiler)
    peers.py        Transformers' experts implementations, sharing moekit's weights
    runner.py       the contract: (shape, tokens, backend, mode) -> Measurement
    sweep.py        presets x tokens x backends x modes -> long-format ResultRows
    results.py      the CSV schema, provenance, atomic CSV / JSON files
    plots.py        PNGs from rows;  report.py  report.md from rows
    cli.py          `moekit bench`;  report_cli.py  `moekit report DIR`
    args.py         argument types and up-front checks shared by every subcommand; exit statuses

Only the light modules are imported here; plotting pulls in matplotlib when it is used.
"""

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
