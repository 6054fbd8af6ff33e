"""Result rows: the long-format CSV schema, provenance, and atomic CSV / JSON files.

One row per measurement (preset x T x backend x mode). Every row carries its provenance (device,
commit, date, versions) and the ceilings of its run, so rows from different runs can be appended
into one file and still be read on their own. Plots and the report are drawn from these rows only.

The CSV code is generic over a frozen row dataclass: its fields, in order, are the columns, and each
field's annotation (str, float, int or int | None) says how a cell is written and read back. The
`moekit ep-bench` rows (`moekit.bench.ep_report`) and the `moekit imbalance` rows
(`moekit.bench.imbalance_report`) use the same functions with their own row types.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import json
import math
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

import torch

from moekit import env

SCHEMA_VERSION = 1
STATUSES = ("ok", "failed", "error", "skipped", "not_capturable")
DIRECTIONS = ("fwd", "fwd+bwd")   # a `moekit bench` row's pass: the forward, or forward + backward
FP8 = "fp8"   # ResultRow.weights of a call on block-scaled FP8 expert weights (`moekit bench --weights fp8`)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1   # what numpy and torch hold in an integer column


@dataclass(frozen=True)
class Provenance:
    """Where and with what a run was measured; copied into each of its rows. fp8_tflops: the FP8
    matmul ceiling (`ceilings.fp8_ceiling`) of a run that measured it, NaN (an empty cell) otherwise
    and in files written before the column; switches: the MOEKIT_* switches set away from their
    defaults (`env.changed`), empty in files written before the column; both keyword-only, so row
    types add their fields after them."""

    run_id: str
    date: str
    commit: str
    device_type: str
    device_name: str
    torch_version: str
    triton_version: str
    transformers_version: str
    python_version: str
    moekit_version: str
    dtype: str
    copy_gbps: float
    matmul_tflops: float
    fp8_tflops: float = field(default=math.nan, kw_only=True)
    switches: str = field(default="", kw_only=True)


@dataclass(frozen=True)
class LayerRow(Provenance):
    """A run's `Provenance`, then the layer (preset and its shape) and the token count measured:
    the leading columns of `moekit bench`, `imbalance` and `tune` rows."""

    preset: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    tokens: int


@dataclass(frozen=True)
class ResultRow(LayerRow):
    """One measurement: its run's `Provenance` and layer columns, then the case and its statistics.
    Times in ms, bytes in bytes, rates in GB/s and TFLOP/s; NaN / None when the case was not timed
    (status other than "ok") or the quantity does not exist (busy time on the CPU).

    The trailing columns carry defaults, so CSVs written before them still read: `threads`;
    `direction`, "fwd" (the forward) or "fwd+bwd" (`moekit bench --backward`: one forward + backward,
    its bytes, FLOPs and floor those of `roofline.training_traffic`, max_err and tol those of the
    gradient closest to its budget); `peak_mib`, device memory one call took above what was held
    before (fwd+bwd rows on CUDA; NaN where not measured, e.g. on the CPU); `cache`, "flushed" (the
    last-level cache written over before each timed call), "flushed clean" (written over, then
    another buffer read: `moekit bench --flush clean`) or "warm" (no flush: `moekit bench`'s CPU
    default), empty in rows written before it; `rows_per_pair`, triton rows only (NaN elsewhere and
    before the column): the rows its GEMM tiles compute per valid pair, num_padded of its alignment
    over the pairs (1.24: 19% of the rows computed are padding; `moekit.bench.kernel_work`);
    `weights`, the expert weights the call ran on: the dtype's name (the dense weights in `dtype`) or
    "fp8" (block-scaled e4m3, `moekit bench --weights fp8`: its bytes those of
    `roofline.fp8_traffic`, its floor on the FP8 roof `fp8_tflops`), empty in rows written before it
    (the dense weights).

    The dense pair's rows (backend "dense", `moekit.bench.dense`: the layer's FLOPs as two dense
    matmuls through one expert) carry the layer's bytes, FLOPs and floor, so their pct_floor and
    tflops set them against the same bar as the backends (their gbps is the layer's bytes over
    their time, not what they moved).
    """

    backend: str
    mode: str
    status: str
    reason: str
    max_err: float
    tol: float
    median_ms: float
    p20_ms: float
    p80_ms: float
    n_rep: int | None
    bytes: int
    flops: int
    floor_ms: float
    bound: str
    pct_floor: float
    gbps: float
    tflops: float
    kernels: int | None
    busy_ms: float
    idle_pct: float
    experts_hit: int
    experts_hit_mean: float
    experts_expected: float
    threads: int | None = None   # torch intra-op threads of a CPU run (empty on a GPU, or before --threads)
    direction: str = "fwd"
    peak_mib: float = math.nan
    cache: str = ""
    rows_per_pair: float = math.nan
    weights: str = ""

    @property
    def on_fp8(self) -> bool:
        """Whether the call ran on block-scaled FP8 weights."""
        return self.weights == FP8

    @property
    def series(self) -> str:
        """The backend as tables and plots name it: "triton", or "triton fp8" on FP8 weights."""
        return f"{self.backend} {FP8}" if self.on_fp8 else self.backend


@dataclass(frozen=True)
class MeasuredColumns:
    """The columns of one `run_case` measurement that the studies on one row type per case share
    (`imbalance`, `ablate`), filled by `moekit.bench.runner.Measurement.columns()`. A mixin: a row
    type lists it before its case's dataclass (`class Row(MeasuredColumns, Case)`), so these columns
    follow the case's (fields are collected in reverse method-resolution order).

    status, reason: as in `moekit bench` (ok, failed, error, skipped, ...). Times in ms; NaN / None
    when the case was not timed.
    """

    status: str
    reason: str = ""
    max_err: float = math.nan
    median_ms: float = math.nan
    p20_ms: float = math.nan
    p80_ms: float = math.nan
    n_rep: int | None = None
    floor_ms: float = math.nan
    pct_floor: float = math.nan
    kernels: int | None = None


_KINDS = ("str", "float", "int", "int | None")


@functools.cache
def _schema(row_type: type) -> tuple[tuple[str, str], ...]:
    """(column, kind) per field of a row dataclass, in field order; kind is one of _KINDS."""
    schema = []
    for f in fields(row_type):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if kind not in _KINDS:
            raise TypeError(f"{row_type.__name__}.{f.name}: a CSV column's type must be one of {_KINDS}, "
                            f"got {kind!r}")
        schema.append((f.name, kind))
    return tuple(schema)


def columns(row_type: type) -> tuple[str, ...]:
    """The CSV columns of a row dataclass: its field names, in order."""
    return tuple(name for name, _ in _schema(row_type))


COLUMNS: tuple[str, ...] = columns(ResultRow)


def git_commit() -> str:
    """Commit of the moekit source tree, "+dirty" when it has local changes; "" outside git, and
    where the git tree around the package does not track it (an installed moekit inside another
    project's repository: that project's commit is no provenance of moekit's).

    MOEKIT_COMMIT, when set, wins: a source tree copied without its .git (as the GPU runs are)
    says its commit that way.
    """
    if os.environ.get("MOEKIT_COMMIT"):
        return os.environ["MOEKIT_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        tracked = subprocess.run(["git", "-C", str(here), "ls-files", "--error-unmatch", Path(__file__).name],
                                 capture_output=True, text=True, timeout=10)
        if tracked.returncode != 0:
            return ""
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return ""
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{_cpu_model()} ({os.cpu_count()} cores)"


def collect_provenance(device: torch.device, dtype: torch.dtype, copy_gbps: float, matmul_tflops: float,
                       *, transformers_version: str | None = None,
                       fp8_tflops: float = math.nan) -> Provenance:
    import triton

    import moekit

    now = datetime.now(timezone.utc)
    return Provenance(
        run_id=now.strftime("%Y%m%dT%H%M%SZ"),
        date=now.isoformat(timespec="seconds"),
        commit=git_commit(),
        device_type=device.type,
        device_name=device_name(device),
        torch_version=torch.__version__,
        triton_version=triton.__version__,
        transformers_version=transformers_version or "",
        python_version=platform.python_version(),
        moekit_version=moekit.__version__,
        dtype=str(dtype).removeprefix("torch."),
        copy_gbps=copy_gbps,
        matmul_tflops=matmul_tflops,
        fp8_tflops=fp8_tflops,
        switches=env.changed(),
    )


def _format(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(value)
    return str(value)


def _parse(column: str, kind: str, text: str, where: str) -> object:
    if kind == "str":
        return text
    if text == "":
        if kind == "float":
            return math.nan
        if kind == "int | None":
            return None
        raise ValueError(f"{where}: column {column!r} is empty but must hold an integer")
    shown = repr(text) if len(text) <= 40 else f"'{text[:20]}...' ({len(text)} characters)"
    what = "a number" if kind == "float" else f"an integer in [{INT64_MIN}, {INT64_MAX}]"
    try:
        value = float(text) if kind == "float" else int(text)    # int() refuses over 4300 digits too
    except ValueError:
        raise ValueError(f"{where}: column {column!r} must hold {what}, got {shown}") from None
    if kind != "float" and not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{where}: column {column!r} must hold {what}, got {shown}")
    return value


def _file_mode() -> int:
    """The mode a plain open() would give a new file (mkstemp's temporaries are 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write through a temporary file in the same folder, then rename: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def rows_to_csv(rows: Iterable[object], row_type: type = ResultRow, *, header: bool = True) -> str:
    """CSV text of rows of `row_type`: NaN and None as empty cells, floats exact (repr)."""
    cols = columns(row_type)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    if header:
        writer.writerow(cols)
    for row in rows:
        writer.writerow([_format(getattr(row, c)) for c in cols])
    return buf.getvalue()


def write_csv(rows: Iterable[object], path: Path, row_type: type = ResultRow) -> None:
    atomic_write_text(path, rows_to_csv(rows, row_type))


def json_text(rows: Iterable[ResultRow]) -> str:
    """results.json: the schema version, the columns and one object per row."""
    def clean(v: object) -> object:
        # JSON has no NaN or Infinity: non-finite numbers (not timed, or an infinite error) -> null.
        return None if isinstance(v, float) and not math.isfinite(v) else v

    doc = {"schema_version": SCHEMA_VERSION, "columns": list(COLUMNS),
           "rows": [{k: clean(v) for k, v in asdict(r).items()} for r in rows]}
    return json.dumps(doc, indent=1) + "\n"


def write_json(rows: Iterable[ResultRow], path: Path) -> None:
    atomic_write_text(path, json_text(rows))


def claim_folder(out_dir: Path, csv_name: str, result_names: Iterable[str]) -> Path:
    """out_dir, or, when results reached it after the run checked it (another run given the same
    --out, or started in the same second with the default folder), the first of out_dir-2,
    out_dir-3, ... that holds none: claimed by creating its empty csv_name exclusively (O_EXCL), so
    no two runs claim one folder and none replaces results it did not find."""
    out_dir = Path(out_dir)
    names = tuple(result_names)
    for i in range(1, 10_000):
        folder = out_dir if i == 1 else out_dir.with_name(f"{out_dir.name}-{i}")
        folder.mkdir(parents=True, exist_ok=True)
        if any((folder / n).exists() for n in names):
            continue
        try:
            os.close(os.open(folder / csv_name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, _file_mode()))
        except FileExistsError:
            continue
        return folder
    raise RuntimeError(f"{out_dir}: every folder name up to {out_dir.name}-9999 already holds results")


def write_files(files: Mapping[str, str | bytes], out_dir: Path) -> list[Path]:
    """Write already rendered files (name -> text or bytes) into out_dir, each atomically, in order.

    Render everything first, then call this: a failure while rendering then leaves nothing behind,
    instead of plots without the report that goes with them.
    """
    out_dir = Path(out_dir)
    paths = []
    for name, data in files.items():
        path = out_dir / name
        if isinstance(data, str):
            atomic_write_text(path, data)
        else:
            atomic_write(path, lambda tmp, data=data: tmp.write_bytes(data))
        paths.append(path)
    return paths


def _number(v: object) -> str:
    return "an empty cell" if v is None or (isinstance(v, float) and math.isnan(v)) else repr(v)


def positive_problem(row: object, *names: str, empty_ok: bool = False) -> str:
    """"" when every named column of the row holds a finite number > 0 (or is empty, if empty_ok)."""
    for name in names:
        v = getattr(row, name)
        if empty_ok and (v is None or (isinstance(v, float) and math.isnan(v))):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            return f"column {name!r} must be a finite number > 0, got {_number(v)}"
    return ""


def check_provenance(row: Provenance) -> str:
    """"" when the provenance columns can be used: positive ceilings, a torch dtype name."""
    if not isinstance(getattr(torch, row.dtype, None), torch.dtype):
        return f"column 'dtype' must name a torch dtype, got {row.dtype!r}"
    return (positive_problem(row, "copy_gbps", "matmul_tflops")
            or positive_problem(row, "fp8_tflops", empty_ok=True))


def switches_lines(row: Provenance) -> list[str]:
    """A report's provenance line naming the MOEKIT_* switches its run set away from their defaults
    (`Provenance.switches`), or no line when it set none."""
    return [f"- switches set away from their defaults: `{row.switches}`"] if row.switches else []


def shape_label(row: object) -> str:
    """"<preset> (E=.., H=.., I=.., K=..)": the layer a row measured, as plots and reports name it."""
    return (f"{row.preset} (E={row.num_experts}, H={row.hidden_size}, I={row.intermediate_size}, "
            f"K={row.top_k})")


def check_shape_columns(row: object, tokens: str = "tokens") -> str:
    """"" when num_experts, hidden_size, intermediate_size, top_k and the token count make a layer."""
    problem = positive_problem(row, "num_experts", "hidden_size", "intermediate_size", "top_k", tokens)
    if problem:
        return problem
    if row.top_k > row.num_experts:
        return f"top_k {row.top_k} exceeds num_experts {row.num_experts}"
    return ""


def check_result_row(row: ResultRow) -> str:
    """"" when a `moekit bench` row can be reported; else what is wrong with it."""
    problem = check_provenance(row) or check_shape_columns(row)
    if problem:
        return problem
    if row.direction not in DIRECTIONS:
        return f"column 'direction' must be one of {DIRECTIONS}, got {row.direction!r}"
    if row.weights not in ("", row.dtype, FP8):
        return f"column 'weights' must be {row.dtype!r} (the dtype), {FP8!r} or empty, got {row.weights!r}"
    if row.on_fp8 and row.direction != "fwd":
        return "a row on FP8 weights must be a forward ('fwd'): FP8 experts are inference only"
    problem = positive_problem(row, "floor_ms", "experts_expected", "peak_mib", "rows_per_pair",
                               empty_ok=True)
    if not problem and row.status == "ok":
        problem = positive_problem(row, "median_ms", "p20_ms", "p80_ms")
    if not problem and row.rows_per_pair < 1:       # NaN (not recorded) compares False
        problem = f"column 'rows_per_pair' must be >= 1 (rows computed per pair), got {row.rows_per_pair!r}"
    if not problem and row.n_rep is not None and row.n_rep < 1:
        problem = f"column 'n_rep' must be >= 1, got {row.n_rep}"
    if not problem and row.kernels is not None and row.kernels < 0:
        problem = f"column 'kernels' must be >= 0, got {row.kernels}"
    return problem


def read_csv(path: Path, row_type: type = ResultRow, *, what: str = "a moekit results CSV",
             statuses: tuple[str, ...] | None = STATUSES,
             check: Callable[[object], str] | None = None) -> list:
    """Rows of a CSV of `row_type` rows. Raises ValueError naming the file (and line) on any problem.

    Args:
        what: the kind of file expected, for the messages ("an ep-bench CSV").
        statuses: the values the "status" column may hold (None: any).
        check: row -> "" or what is wrong with it beyond the cell types (a zero ceiling, ...);
            every row is checked, so a caller can validate the whole file before drawing anything.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read {what} ({exc})") from None
    if not text.strip():
        raise ValueError(f"{path}: empty file, expected {what}")
    schema = _schema(row_type)
    try:
        reader = csv.reader(io.StringIO(text))
        header = next(reader, None) or []
        # Columns added to a row type later carry a default: older files without them still read.
        optional = {f.name for f in dataclasses.fields(row_type)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
        missing = [c for c, _ in schema if c not in header and c not in optional]
        if missing:
            raise ValueError(f"{path}: not {what}; missing columns {missing}")
        index = [(c, kind, header.index(c)) for c, kind in schema if c in header]
        rows = []
        for line_no, record in enumerate(reader, start=2):
            if not record:
                continue
            if len(record) != len(header):
                raise ValueError(f"{path}:{line_no}: {len(record)} fields, the header has {len(header)}")
            where = f"{path}:{line_no}"
            values = {c: _parse(c, kind, record[i], where) for c, kind, i in index}
            if statuses is not None and values["status"] not in statuses:
                raise ValueError(f"{where}: status must be one of {statuses}, got {values['status']!r}")
            row = row_type(**values)
            problem = check(row) if check is not None else ""
            if problem:
                raise ValueError(f"{where}: {problem}")
            rows.append(row)
    except csv.Error as exc:
        raise ValueError(f"{path}: malformed CSV ({exc})") from None
    if not rows:
        raise ValueError(f"{path}: no result rows")
    return rows
