"""The backend registry: every way to run the expert path, with what it can do.

A backend is one function with one signature, `run(x, gate_up_proj, down_proj, topk_weights,
topk_ids, options, out) -> (T, H)`, and the capabilities callers need before choosing it:
whether it can run inside a CUDA graph, on which devices autograd can differentiate it, which
`ExpertsOptions` it takes (the expert math beyond SwiGLU among them: biases, the gpt_oss
activation, interleaved gate/up rows) and which of those its backward handles, and a layout check
it needs. `moekit.moe_experts` validates once, then dispatches here; the `moekit::experts` custom op
runs the same entries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from moekit._validation import FLOAT_DTYPES
from moekit.activation import SWIGLU, GatedActivation
from moekit.tuning import SWITCH_FIELDS, ExpertsConfig, check_config_type

# The options that change what an expert computes (`moekit.activation`), not how it is run.
MATH_OPTIONS = frozenset({"gate_up_bias", "down_bias", "activation", "interleaved"})


@dataclass(frozen=True)
class ExpertsOptions:
    """Per-backend options of the expert path; each backend declares which it takes.

    Attributes:
        config: triton, masked: tile config (default: the tuned table for the device and T).
        capacity_factor: padded, masked: cap each expert at ceil(c * S / E) pairs (Switch
            Transformer); pairs past the cap are dropped and counted. masked without it: C = S.
        stats: padded, masked: a dict filled with "capacity" (int) and "dropped" (device scalar).
        gate_up_bias: (E, 2I) added to the gate/up pre-activations (in gate_up_proj's row layout).
        down_bias: (E, H) added to the down projection, before the routing weight.
        activation: a `GatedActivation` other than SwiGLU (None: SwiGLU).
        interleaved: True when gate_up_proj's rows alternate gate, up (None: [gate; up]).
        capacity: masked: C rows per expert given outright, instead of from capacity_factor; set
            by callers of the entry (the low-latency expert-parallel mode's C_e), not a
            `moe_experts` argument. The masked backend's `stats` also get its per-expert counts.
    """

    config: ExpertsConfig | None = None
    capacity_factor: float | None = None
    stats: dict | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    activation: GatedActivation | None = None
    interleaved: bool | None = None
    capacity: int | None = None

    def __post_init__(self) -> None:
        check_config_type(self.config)
        if self.stats is not None and not isinstance(self.stats, dict):
            raise TypeError(f"stats must be a dict or None, got {type(self.stats).__name__} (the backend "
                            "fills a dict)")

    @staticmethod
    def math(gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, activation: GatedActivation,
             interleaved: bool) -> dict:
        """The math fields as given to the constructor: defaults (SwiGLU, [gate; up]) as None."""
        return {"gate_up_bias": gate_up_bias, "down_bias": down_bias,
                "activation": None if activation.is_swiglu else activation,
                "interleaved": True if interleaved else None}

    def math_kwargs(self) -> dict:
        """The expert math as the backends' keyword arguments."""
        return {"gate_up_bias": self.gate_up_bias, "down_bias": self.down_bias,
                "activation": self.activation or SWIGLU, "interleaved": bool(self.interleaved)}

    def given(self) -> list[str]:
        return [name for name in _OPTION_NAMES if getattr(self, name) is not None]


_OPTION_NAMES = tuple(f.name for f in fields(ExpertsOptions))


CONFIG_FIELDS = tuple(ExpertsConfig.__dataclass_fields__)   # a config as the custom ops' int list


def config_of_ints(config: list[int] | None) -> ExpertsConfig | None:
    """An op's int list back to an ExpertsConfig: fields in order, trailing ones at their defaults."""
    if config is None:
        return None
    if len(config) > len(CONFIG_FIELDS):
        raise ValueError(f"config: at most {len(CONFIG_FIELDS)} values ({', '.join(CONFIG_FIELDS)}), "
                         f"got {len(config)}")
    values = dict(zip(CONFIG_FIELDS, config))
    for name in SWITCH_FIELDS:             # a switch travels as 0 or 1
        if name in values and values[name] in (0, 1):
            values[name] = bool(values[name])
    return ExpertsConfig(**values)


RunFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Backend:
    """One implementation of the expert path and its capabilities.

    Attributes:
        name: the `backend=` string.
        run: run(x, gate_up_proj, down_proj, topk_weights, topk_ids, options, out) -> (T, H).
            `out` is None or a checked (T, H) buffer the result must be written into.
        description: one line for docs and reports.
        capturable: no host sync on its default options, so it runs inside a CUDA graph.
        backward_devices: device types on which autograd differentiates it.
        options: the `ExpertsOptions` fields it takes.
        check_layout: raises for strides or sizes it cannot take (before any launch), or None.
        dtypes: the float dtypes it computes in.
        backward_options: the options its backward handles (None: every option it takes); a
            call given another one has no backward (`has_backward`).
        default_config: for a backend whose tiles follow the rows of a call, the config a call
            takes when given none, as default_config(rows, gate_up_proj, top_k, dtype, device); a
            caller that splits one call into chunks passes the whole call's to each (same tiles,
            same summation order); None: the tiles do not follow the rows.
        run_fp8: run_fp8(x, gate_up, down, topk_weights, topk_ids, options, out, ue8m0) -> (T, H)
            for block-scaled FP8 weights (`moekit.quant.Fp8Weight`, inference only); None: the
            backend takes no FP8 weights.
    """

    name: str
    run: RunFn
    description: str
    capturable: bool = False
    backward_devices: frozenset[str] = frozenset({"cpu", "cuda"})
    options: frozenset[str] = frozenset()
    check_layout: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    backward_options: frozenset[str] | None = None
    default_config: Callable[..., ExpertsConfig] | None = None
    run_fp8: RunFn | None = None

    def has_backward(self, device: torch.device, options: ExpertsOptions | None = None) -> bool:
        return device.type in self.backward_devices and not self.no_backward_for(options)

    def no_backward_for(self, options: ExpertsOptions | None) -> list[str]:
        """The given options its backward does not handle (empty: none)."""
        if options is None or self.backward_options is None:
            return []
        return [name for name in options.given() if name not in self.backward_options]

    def check_options(self, options: ExpertsOptions) -> None:
        extra = [name for name in options.given() if name not in self.options]
        if extra:
            owners = sorted(b.name for b in _REGISTRY.values() if set(extra) <= b.options)
            where = f"backend={owners[0]!r} only" if len(owners) == 1 else f"backends {owners}"
            raise ValueError(f"{' and '.join(extra)} appl{'y' if len(extra) > 1 else 'ies'} to {where}, "
                             f"not backend={self.name!r}")


_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Add (or replace) a backend under backend.name; returns it."""
    if not backend.name or backend.name == "auto":
        raise ValueError(f"a backend needs a name other than 'auto', got {backend.name!r}")
    _REGISTRY[backend.name] = backend
    return backend


def check_backend_name(backend: object, name: str = "backend") -> None:
    """ValueError naming the argument unless backend is "auto" or a registered backend's name: for
    callers that take a backend before they run one (layers, integrations, expert parallelism)."""
    if backend != "auto" and backend not in backend_names():
        raise ValueError(f"{name} must be 'auto' or one of {backend_names()}, got {backend!r}")


def get_backend(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"backend must be 'auto' or one of {tuple(_REGISTRY)}, got {name!r}") from None


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def fp8_backend_names() -> tuple[str, ...]:
    """The registered backends that take block-scaled FP8 weights (a `run_fp8`), in order."""
    return tuple(name for name, b in _REGISTRY.items() if b.run_fp8 is not None)


def capability_table() -> str:
    """The registered backends' capabilities as a Markdown table (the README's copy is checked
    against it, so the docs cannot drift from the registry)."""

    def names(opts: frozenset[str] | None) -> str:
        return ", ".join(f"`{n}`" for n in _OPTION_NAMES if n in opts) if opts else "–"

    lines = ["| backend | what it is | CUDA graph | backward on | FP8 weights | options "
             "| options its backward takes |",
             "|---|---|---|---|---|---|---|"]
    for b in _REGISTRY.values():
        grad = ", ".join(sorted(b.backward_devices)) or "–"
        back = "–" if not b.backward_devices else "all" if b.backward_options is None else names(
            b.backward_options & b.options)
        lines.append(f"| `{b.name}` | {b.description} | {'yes' if b.capturable else 'no'} | {grad} | "
                     f"{'yes' if b.run_fp8 else 'no'} | {names(b.options)} | {back} |")
    return "\n".join(lines) + "\n"
