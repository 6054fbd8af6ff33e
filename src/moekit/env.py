"""Every environment switch moekit reads, in one table (`SWITCHES`), and the one parser.

A module never reads os.environ for a MOEKIT_* switch itself: it calls `flag` or `text` with the
switch's name. Each switch is read when its row says: at import (`import`: set it before importing
moekit) or at each call (`call`: one process can time both settings).

Flags take 1 / true / yes / on and 0 / false / no / off (any case, spaces ignored); anything else is
an error naming the variable. Unset, a flag takes its default; set but empty, the value in its
`blank` field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Switch:
    """One environment variable: its name, type ("flag", "text" or "path"), its default as written in
    the environment ("" for none), when it is read ("import" or "call"), what it does, and for a flag
    what an empty value stands for (`blank`: "0" or "1")."""

    name: str
    type: Literal["flag", "text", "path"]
    default: str
    read: Literal["import", "call"]
    meaning: str
    blank: str = "0"


# Each switch: "name type default blank read" ("-": none; blank, for a flag: what an empty value
# stands for), then its meaning, indented.
_TABLE = """
MOEKIT_DECODE_DIRECT flag 1 1 call
    the triton backend's direct decode path (two kernels, no align) for a few pairs
MOEKIT_PDL flag 1 0 call
    programmatic dependent launch of the kernels (Hopper and later)
MOEKIT_WEIGHT_EVICT_FIRST flag 1 0 call
    the decode kernels' weight loads carry L2 evict_first in small calls (Hopper and later)
MOEKIT_EAGER_GRAPHS flag 1 0 import
    eager calls of a few tokens replay a cached CUDA graph of the experts (`moekit.eager_graphs`)
MOEKIT_GLUON_WGRAD flag 1 1 call
    the Hopper Gluon kernel for the training step's weight gradients
MOEKIT_GLUON_SWIGLU flag 1 1 call
    the Hopper Gluon kernel for the SwiGLU backward reading the saved pre-activations
MOEKIT_GLUON_FP8 flag 1 1 call
    the Hopper Gluon kernels for FP8 calls' grouped GEMMs (where the align block size is a multiple of 64)
MOEKIT_GLUON_FP8_DUAL flag 1 1 call
    the Hopper Gluon FP8 GEMMs' dual schedule (both consumers' main loops at once; 0: ping-pong)
MOEKIT_WGRAD_TILES text - - call
    the weight-gradient kernel's Triton tiles as key=value pairs (`block_m=32,stages=3`)
MOEKIT_CONFIG_DIR path - - call
    a folder of tuning tables (`<device>.json`) read before the packaged ones
MOEKIT_POISON_WORKSPACES flag 0 0 import
    fresh workspaces filled with NaN (integers: their minimum), to catch rows never written
MOEKIT_LAYOUT_TORCH flag 0 0 call
    the masked layout's torch twin everywhere, CUDA tensors included
MOEKIT_LAYOUT_TRITON flag 0 0 call
    the masked layout's Triton kernel on CPU tensors too (under TRITON_INTERPRET=1)
MOEKIT_EP_TORCH flag 0 0 call
    the expert-parallel steps' torch twins everywhere, CUDA tensors included
MOEKIT_EP_TRITON flag 0 0 call
    the expert-parallel steps' Triton kernels on CPU tensors too (under TRITON_INTERPRET=1)
MOEKIT_COMMIT text - - call
    the commit the lab records with its results, for a source tree without its .git
"""


def _rows(table: str) -> tuple[Switch, ...]:
    lines = table.strip().splitlines()
    rows = []
    for head, meaning in zip(lines[::2], lines[1::2]):
        name, kind, default, blank, read = (cell if cell != "-" else "" for cell in head.split())
        rows.append(Switch(name, kind, default, read, meaning.strip(), blank or "0"))
    return tuple(rows)


SWITCHES: tuple[Switch, ...] = _rows(_TABLE)
_BY_NAME = {s.name: s for s in SWITCHES}


def switch(name: str) -> Switch:
    """The table's row of `name` (KeyError for a name moekit does not read)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not an environment switch of moekit (see moekit.env.SWITCHES)") from None


def flag(name: str) -> bool:
    """Flag `name` as set in the environment now (module docstring: accepted values)."""
    row = switch(name)
    if row.type != "flag":
        raise TypeError(f"${name} is a {row.type}, not a flag")
    raw = os.environ.get(name)
    value = row.default if raw is None else (raw.strip().lower() or row.blank)
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError(f"${name} must be 1 or 0 (also true/false, yes/no, on/off), got {raw!r}")


def check_all() -> None:
    """ValueError naming the first flag set to something that is no flag value: a program can refuse
    it before any work, wherever (and whenever) moekit would read it."""
    for s in SWITCHES:
        if s.type == "flag":
            flag(s.name)


def text(name: str) -> str:
    """Text or path switch `name` as set in the environment now, spaces stripped ("" when unset)."""
    row = switch(name)
    if row.type == "flag":
        raise TypeError(f"${name} is a flag: read it with moekit.env.flag")
    return os.environ.get(name, row.default).strip()


def changed() -> str:
    """The switches set in the environment to something other than their default, as
    "NAME=value" joined by spaces ("" when none): what a recorded measurement ran with. MOEKIT_COMMIT
    is left out (the lab records the commit itself)."""
    out = []
    for s in SWITCHES:
        raw = os.environ.get(s.name)
        if raw is None or s.name == "MOEKIT_COMMIT":
            continue
        if s.type == "flag":
            if flag(s.name) != (s.default.lower() in ON):
                out.append(f"{s.name}={int(flag(s.name))}")
        elif raw.strip() != s.default:
            out.append(f"{s.name}={raw.strip()}")
    return " ".join(out)


def markdown_table() -> str:
    """`SWITCHES` as a markdown table: variable, type, default, when read, meaning."""
    lines = ["| Variable | Type | Default | Read | Meaning |", "| --- | --- | --- | --- | --- |"]
    for s in SWITCHES:
        default = f"`{s.default}`" if s.default else "unset"
        read = "at import" if s.read == "import" else "at each call"
        lines.append(f"| `{s.name}` | {s.type} | {default} | {read} | {s.meaning} |")
    return "\n".join(lines) + "\n"
