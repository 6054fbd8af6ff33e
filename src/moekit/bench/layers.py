"""The layer a study measures: a preset, a `--shape E=..,H=..,I=..,K=..` or a Transformers config.json.

    preset_layer("tiny")                          Layer("tiny", MoEShape(8, 64, 48, 2))
    parse_shape("E=8,H=4096,I=14336,K=2")         Layer("shape:E=8,H=4096,I=14336,K=2", ...)
    read_config("models/Qwen3-30B-A3B/config.json")  Layer("qwen3_moe:Qwen3-30B-A3B", ...)

A layer's name is what result rows record in their `preset` column (the CSV schema is unchanged):
the preset's name, the shape written out in a fixed order ("norm=0" added when the top-k weights
are not renormalised), or the config's model_type and its file's stem (its folder's name for a
file called config.json). `file_stem` turns a name into one that plot files may carry.

A config is read offline with `json` (no network, no Transformers), from the keys of Qwen3-MoE,
Qwen2-MoE, OLMoE, Mixtral, DeepSeek-V2/V3 and GPT-OSS configs (a multimodal config's
"text_config" too):

    E   n_routed_experts | num_local_experts | num_experts      (one of them; equal if several)
    K   num_experts_per_tok
    H   hidden_size
    I   moe_intermediate_size, else intermediate_size
    norm_topk_prob   when absent: what the model does (Mixtral and GPT-OSS renormalise the top-k
                     weights; Transformers' default for the others; True, with a note, otherwise)

What moekit's layer does not hold is named in the layer's `notes` (a study prints them): DeepSeek's
and Qwen2-MoE's shared experts (n_shared_experts, shared_expert_intermediate_size), GPT-OSS's expert
biases and clamped SwiGLU (model_type gpt_oss, swiglu_limit; the gpt-oss-20b preset too: moekit's
expert path runs them, `moe_experts(activation="gpt_oss", ...)`, the studies' layer does not). Every
problem is a ValueError of one line naming the file (or the --shape text) and the key.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from moekit.shapes import PRESETS, MoEShape

SHAPE_KEYS = {"E": "num_experts", "H": "hidden_size", "I": "intermediate_size", "K": "top_k"}
SHAPE_SYNTAX = "E=<experts>,H=<hidden>,I=<intermediate>,K=<top_k>[,norm=0|1]"
EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")
INTERMEDIATE_KEYS = ("moe_intermediate_size", "intermediate_size")
# Whether the model renormalises its top-k weights when its config has no norm_topk_prob key.
NORM_WHEN_ABSENT = {"mixtral": True, "gpt_oss": True, "qwen3_moe": False, "qwen2_moe": False,
                    "olmoe": False, "deepseek_v2": False, "deepseek_v3": True}


@dataclass(frozen=True)
class Layer:
    """A named layer shape. name: the rows' `preset` column; notes: what the source holds that
    moekit's layer does not (printed by the study, never silently dropped)."""

    name: str
    shape: MoEShape
    notes: tuple[str, ...] = ()


def _gpt_oss_note(where: str, key: str) -> str:
    return (f"{where}: {key}: GPT-OSS experts add biases (gate_up_proj_bias, down_proj_bias) and a clamped "
            "SwiGLU on interleaved rows; moekit's expert path runs them (moe_experts(activation='gpt_oss', "
            "...)), the measured layer is SwiGLU without them (same weight bytes)")


PRESET_NOTES = {"gpt-oss-20b": (_gpt_oss_note("preset gpt-oss-20b", "model_type 'gpt_oss'"),)}


def preset_layer(name: str) -> Layer:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return Layer(name, PRESETS[name], PRESET_NOTES.get(name, ()))


def shape_name(shape: MoEShape) -> str:
    """"shape:E=8,H=4096,I=14336,K=2" (",norm=0" when the top-k weights are not renormalised)."""
    name = (f"shape:E={shape.num_experts},H={shape.hidden_size},I={shape.intermediate_size},"
            f"K={shape.top_k}")
    return name if shape.norm_topk_prob else name + ",norm=0"


def file_stem(name: str) -> str:
    """A layer name as plot file names carry it: letters, digits, '.', '_' and '-' only (a preset's
    name is unchanged; "shape:E=8,H=64,I=48,K=2" -> "shape_E8_H64_I48_K2")."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name.replace("=", "")).strip("_") or "layer"


def _check_top_k(e: int, k: int, where: str, e_name: str, k_name: str) -> None:
    if k > e:
        raise ValueError(f"{where}: {k_name} {k} exceeds {e_name} {e} (top_k must be <= the experts)")


def parse_shape(text: str) -> Layer:
    """A layer from "E=..,H=..,I=..,K=..[,norm=0|1]" (any order, spaces allowed)."""
    where = f"{text!r}"
    values: dict[str, int] = {}
    for item in (s.strip() for s in text.split(",")):
        key, sep, value = (s.strip() for s in item.partition("="))
        key = key.upper() if key.upper() in SHAPE_KEYS else key.lower()
        if not sep or key not in (*SHAPE_KEYS, "norm"):
            raise ValueError(f"{where}: expected {SHAPE_SYNTAX}; bad item {item!r}")
        if key in values:
            raise ValueError(f"{where}: {key} is given twice")
        if not re.fullmatch(r"[0-9]+", value):
            raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
        values[key] = int(value)
    missing = [k for k in SHAPE_KEYS if k not in values]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}; expected {SHAPE_SYNTAX}")
    for k in SHAPE_KEYS:
        if values[k] < 1:
            raise ValueError(f"{where}: {k} must be >= 1, got {values[k]}")
    if values.get("norm", 1) not in (0, 1):
        raise ValueError(f"{where}: norm must be 0 or 1, got {values['norm']}")
    _check_top_k(values["E"], values["K"], where, "E", "K")
    shape = MoEShape(*(values[k] for k in SHAPE_KEYS), norm_topk_prob=bool(values.get("norm", 1)))
    return Layer(shape_name(shape), shape)


def _load_json(path: Path) -> dict:
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    try:
        raw = json.loads(text)
    except RecursionError:
        raise ValueError(f"{path}: not a JSON config (nested too deeply)") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object (a Transformers config.json), got "
                         f"{type(raw).__name__}")
    return raw


def _int_key(cfg: dict, key: str, where: str) -> int:
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{where}: {key!r} must be an integer, got {json.dumps(v)}")
    if v < 1:
        raise ValueError(f"{where}: {key!r} must be >= 1, got {v}")
    return v


def _present(cfg: dict, keys: tuple[str, ...]) -> list[str]:
    return [k for k in keys if cfg.get(k) is not None]


def _num_experts(cfg: dict, where: str) -> tuple[int, str]:
    found = _present(cfg, EXPERT_KEYS)
    if not found:
        raise ValueError(f"{where}: missing the number of experts (one of {', '.join(EXPERT_KEYS)}); "
                         "is it an MoE model's config?")
    values = {k: _int_key(cfg, k, where) for k in found}
    if len(set(values.values())) > 1:
        raise ValueError(f"{where}: the number of experts disagrees: "
                         + ", ".join(f"{k}={v}" for k, v in values.items()))
    return values[found[0]], found[0]


def _notes(cfg: dict, model_type: str, where: str) -> tuple[str, ...]:
    notes = []
    for key in ("n_shared_experts", "shared_expert_intermediate_size"):
        v = cfg.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            notes.append(f"{where}: {key}={v}: shared experts are outside moekit's layer; only the routed "
                         "experts are measured")
    if model_type == "gpt_oss" or "swiglu_limit" in cfg:
        key = "model_type 'gpt_oss'" if model_type == "gpt_oss" else f"swiglu_limit={cfg['swiglu_limit']}"
        notes.append(_gpt_oss_note(where, key))
    return tuple(notes)


def config_name(path: Path, model_type: str) -> str:
    """"<model_type>:<file stem>" (the folder's name for config.json), in plain characters."""
    stem = Path(path).stem
    if stem == "config":
        stem = Path(path).resolve().parent.name or stem
    return f"{model_type or 'config'}:{re.sub(r'[^A-Za-z0-9._-]+', '_', stem)}"


def read_config(path: str | Path) -> Layer:
    """The MoE layer of a Transformers config.json (see the module docstring for the keys)."""
    path = Path(path)
    cfg = _load_json(path)
    where = str(path)
    if not _present(cfg, EXPERT_KEYS) and isinstance(cfg.get("text_config"), dict):
        text = cfg["text_config"]
        cfg = {**text, "model_type": text.get("model_type", cfg.get("model_type"))}
        where = f"{path} [text_config]"
    model_type = cfg.get("model_type", "")
    if not isinstance(model_type, str):
        raise ValueError(f"{where}: 'model_type' must be a string, got {json.dumps(model_type)}")
    e, e_key = _num_experts(cfg, where)
    inter = _present(cfg, INTERMEDIATE_KEYS)
    missing = [k for k in ("num_experts_per_tok", "hidden_size") if cfg.get(k) is None]
    if not inter:
        missing.append(" or ".join(INTERMEDIATE_KEYS))
    if missing:
        raise ValueError(f"{where}: missing key{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    k = _int_key(cfg, "num_experts_per_tok", where)
    h = _int_key(cfg, "hidden_size", where)
    i = _int_key(cfg, inter[0], where)
    _check_top_k(e, k, where, e_key, "num_experts_per_tok")
    notes = list(_notes(cfg, model_type, where))
    if "norm_topk_prob" in cfg:
        norm = cfg["norm_topk_prob"]
        if not isinstance(norm, bool):
            raise ValueError(f"{where}: 'norm_topk_prob' must be true or false, got {json.dumps(norm)}")
    else:
        norm = NORM_WHEN_ABSENT.get(model_type, True)
        if model_type not in NORM_WHEN_ABSENT:
            notes.append(f"{where}: no norm_topk_prob key; the top-k weights are renormalised (moekit's "
                         "default)")
    return Layer(config_name(path, model_type), MoEShape(e, h, i, k, norm_topk_prob=norm), tuple(notes))
