"""--shape and --config: the layer of a study from "E=..,H=..,I=..,K=.." or a Transformers config.json
(read offline), parse-time errors of one line naming the flag and the file, and the studies run on
the CPU with such a layer, its name in the rows' preset column, `moekit report` redrawing it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import DATA, error_line, run_cli
from moekit.bench.layers import Layer, file_stem, parse_shape, read_config
from moekit.bench.results import read_csv
from moekit.cli import main
from moekit.shapes import PRESETS, MoEShape

CONFIGS = DATA / "configs"
MIXTRAL, QWEN3 = CONFIGS / "mixtral_tiny.json", CONFIGS / "qwen3_moe_tiny.json"


# --shape


@pytest.mark.parametrize("text,shape,name", [
    ("E=8,H=4096,I=14336,K=2", MoEShape(8, 4096, 14336, 2), "shape:E=8,H=4096,I=14336,K=2"),
    (" K=2, I=48 ,h=64,e=8 ", MoEShape(8, 64, 48, 2), "shape:E=8,H=64,I=48,K=2"),
    ("E=8,H=64,I=48,K=2,norm=0", MoEShape(8, 64, 48, 2, False), "shape:E=8,H=64,I=48,K=2,norm=0"),
    ("E=8,H=64,I=48,K=8,norm=1", MoEShape(8, 64, 48, 8, True), "shape:E=8,H=64,I=48,K=8"),
])
def test_shape_is_parsed_and_named_in_a_fixed_order(text, shape, name):
    assert parse_shape(text) == Layer(name, shape)
    assert parse_shape(name.removeprefix("shape:")) == Layer(name, shape)   # the name reads back


@pytest.mark.parametrize("text,message", [
    ("E=8,H=64,I=48", "missing K"),
    ("E=8,H=64,I=48,K=9", "K 9 exceeds E 8"),
    ("E=8,H=64,I=48,K=0", "K must be >= 1"),
    ("E=8,H=64,I=48.5,K=2", "I must be a positive integer, got '48.5'"),
    ("E=8,H=-64,I=48,K=2", "H must be a positive integer"),
    ("E=8,H=64,I=48,K=2,norm=2", "norm must be 0 or 1"),
    ("E=8,H=64,I=48,K=2,X=1", "bad item 'X=1'"),
    ("E=8,E=9,H=64,I=48,K=2", "E is given twice"),
    ("qwen3-30b-a3b", "expected E=<experts>"),
])
def test_bad_shape_is_one_line_naming_the_text(text, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_shape(text)
    assert repr(text) in str(info.value) and "\n" not in str(info.value)


# --config


def write(tmp_path: Path, cfg: object, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg), encoding="utf-8")
    return path


def test_the_committed_example_configs():
    mixtral = read_config(MIXTRAL)
    assert mixtral == Layer("mixtral:mixtral_tiny", MoEShape(4, 64, 96, 2, norm_topk_prob=True))
    qwen = read_config(QWEN3)   # moe_intermediate_size wins over the dense intermediate_size
    assert qwen == Layer("qwen3_moe:qwen3_moe_tiny", MoEShape(16, 64, 32, 4, norm_topk_prob=True))


# Key sets of the real configs (numbers made small): which keys name E, I and the renormalisation.
FAMILIES = [
    ("qwen3_moe", dict(num_experts=16, num_experts_per_tok=4, hidden_size=64, moe_intermediate_size=32,
                       intermediate_size=192, norm_topk_prob=True), MoEShape(16, 64, 32, 4, True), 0),
    ("qwen3_moe", dict(num_local_experts=16, num_experts_per_tok=4, hidden_size=64, moe_intermediate_size=32),
     MoEShape(16, 64, 32, 4, False), 0),                      # Transformers 5's spelling; its default
    ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, hidden_size=64, moe_intermediate_size=32,
                       shared_expert_intermediate_size=128, intermediate_size=128),
     MoEShape(8, 64, 32, 2, False), 1),                       # a shared expert: one note
    ("olmoe", dict(num_experts=8, num_experts_per_tok=2, hidden_size=64, intermediate_size=32,
                   norm_topk_prob=False), MoEShape(8, 64, 32, 2, False), 0),
    ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2, hidden_size=64, intermediate_size=96),
     MoEShape(8, 64, 96, 2, True), 0),
    ("deepseek_v2", dict(n_routed_experts=8, num_experts_per_tok=2, hidden_size=64, moe_intermediate_size=24,
                         intermediate_size=256, n_shared_experts=2, norm_topk_prob=False),
     MoEShape(8, 64, 24, 2, False), 1),
    ("deepseek_v3", dict(n_routed_experts=16, num_experts_per_tok=4, hidden_size=64, moe_intermediate_size=32,
                         n_shared_experts=1), MoEShape(16, 64, 32, 4, True), 1),
    ("gpt_oss", dict(num_local_experts=8, num_experts_per_tok=2, hidden_size=64, intermediate_size=64,
                     swiglu_limit=7.0), MoEShape(8, 64, 64, 2, True), 1),
]


@pytest.mark.parametrize("model_type,keys,shape,notes", FAMILIES,
                         ids=[f"{f[0]}-{i}" for i, f in enumerate(FAMILIES)])
def test_config_families(tmp_path, model_type, keys, shape, notes):
    folder = tmp_path / "My-Model"
    folder.mkdir()
    layer = read_config(write(folder, {"model_type": model_type, **keys}))
    assert layer.shape == shape
    assert layer.name == f"{model_type}:My-Model"          # config.json: named by its folder
    assert len(layer.notes) == notes


def test_what_moekit_does_not_hold_is_named_in_a_note(tmp_path):
    deepseek = read_config(write(tmp_path, {"model_type": "deepseek_v3", "n_routed_experts": 8,
                                            "num_experts_per_tok": 2, "hidden_size": 64,
                                            "moe_intermediate_size": 32, "n_shared_experts": 1}))
    assert "n_shared_experts=1" in deepseek.notes[0] and "shared experts" in deepseek.notes[0]
    gpt = read_config(write(tmp_path, {"model_type": "gpt_oss", "num_local_experts": 8,
                                       "num_experts_per_tok": 2, "hidden_size": 64, "intermediate_size": 64}))
    assert "gpt_oss" in gpt.notes[0] and "bias" in gpt.notes[0]
    unknown = read_config(write(tmp_path, {"num_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64,
                                           "intermediate_size": 64}, "odd.json"))
    assert unknown.name == "config:odd" and unknown.shape.norm_topk_prob
    assert "norm_topk_prob" in unknown.notes[0]


def test_gpt_oss_20b_preset_is_its_config(tmp_path):
    """The gpt-oss-20b preset is what its config.json (the MoE keys of openai/gpt-oss-20b) reads as,
    its router (softmax over the top-4 logits) a renormalised top-4 softmax; both name the experts'
    biases and clamped activation, which the measured layer leaves out."""
    from moekit.bench.layers import preset_layer

    folder = tmp_path / "gpt-oss-20b"
    folder.mkdir()
    layer = read_config(write(folder, {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
        "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
        "num_hidden_layers": 24, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.9}))
    assert layer.shape == PRESETS["gpt-oss-20b"] == MoEShape(32, 2880, 2880, 4, norm_topk_prob=True)
    preset = preset_layer("gpt-oss-20b")
    for note in (*layer.notes, *preset.notes):
        assert "gate_up_proj_bias" in note and "activation='gpt_oss'" in note


def test_a_multimodal_config_s_text_config(tmp_path):
    layer = read_config(write(tmp_path, {"model_type": "qwen3_vl_moe", "text_config": {
        "model_type": "qwen3_vl_moe_text", "num_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64,
        "moe_intermediate_size": 32, "norm_topk_prob": True}}, "vl.json"))
    assert layer == Layer("qwen3_vl_moe_text:vl", MoEShape(8, 64, 32, 2))


GOOD = {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64,
        "intermediate_size": 96}
BAD_CONFIGS = [
    ("not-json", "{'model_type': 'mixtral'}", "not JSON"),
    ("empty", "", "not JSON"),
    ("list", "[1, 2]", "expected a JSON object"),
    ("no-experts", {k: v for k, v in GOOD.items() if k != "num_local_experts"},
     "missing the number of experts"),
    ("no-top-k", {k: v for k, v in GOOD.items() if k != "num_experts_per_tok"},
     "missing key num_experts_per_tok"),
    ("no-sizes", {k: v for k, v in GOOD.items() if k not in ("hidden_size", "intermediate_size")},
     "missing keys hidden_size, moe_intermediate_size or intermediate_size"),
    ("null-top-k", {**GOOD, "num_experts_per_tok": None}, "missing key num_experts_per_tok"),
    ("string", {**GOOD, "hidden_size": "64"}, "'hidden_size' must be an integer, got \"64\""),
    ("float", {**GOOD, "intermediate_size": 96.0}, "'intermediate_size' must be an integer, got 96.0"),
    ("bool", {**GOOD, "num_local_experts": True}, "'num_local_experts' must be an integer, got true"),
    ("zero", {**GOOD, "hidden_size": 0}, "'hidden_size' must be >= 1"),
    ("top-k-over-e", {**GOOD, "num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds num_local_experts 8"),
    ("norm-string", {**GOOD, "norm_topk_prob": "true"}, "'norm_topk_prob' must be true or false"),
    ("disagree", {**GOOD, "num_experts": 16},
     "the number of experts disagrees: num_local_experts=8, num_experts=16"),
    ("model-type", {**GOOD, "model_type": 3}, "'model_type' must be a string"),
]


@pytest.mark.parametrize("name,content,message", BAD_CONFIGS, ids=[b[0] for b in BAD_CONFIGS])
def test_bad_config_is_one_line_naming_the_file_and_the_key(tmp_path, name, content, message):
    path = write(tmp_path, content, f"{name}.json")
    with pytest.raises(ValueError) as info:
        read_config(path)
    assert str(path) in str(info.value) and message in str(info.value) and "\n" not in str(info.value)


def test_unreadable_config(tmp_path):
    path = tmp_path / "bin.json"
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ValueError, match="not UTF-8"):
        read_config(path)
    with pytest.raises(ValueError, match="cannot read it"):
        read_config(tmp_path)


def test_file_stem():
    for name in PRESETS:
        assert file_stem(name) == name                      # presets keep their plot file names
    assert file_stem("shape:E=8,H=4096,I=14336,K=2,norm=0") == "shape_E8_H4096_I14336_K2_norm0"
    assert file_stem("qwen3_moe:Qwen3-30B-A3B") == "qwen3_moe_Qwen3-30B-A3B"
    assert file_stem("../../etc/x y") == ".._.._etc_x_y" and "/" not in file_stem("a/b")


# The flags: parse-time errors, one line naming the flag.


SHAPE_COMMANDS = ["bench", "imbalance", "ep-bench", "tune"]


@pytest.mark.parametrize("command", SHAPE_COMMANDS)
@pytest.mark.parametrize("argv,message", [
    (["--config", "{bad}"], "argument --config: {bad}: not JSON"),
    (["--config", "{missing}"], "argument --config: {missing}: missing key num_experts_per_tok"),
    (["--config", "/nonexistent/config.json"], "argument --config: /nonexistent/config.json: cannot read it"),
    (["--shape", "E=8,H=64,I=48,K=9"], "argument --shape: 'E=8,H=64,I=48,K=9': K 9 exceeds E 8"),
    (["--shape", "E=8,H=64"], "argument --shape: 'E=8,H=64': missing I, K"),
    (["--preset", "tiny", "--shape", "E=8,H=64,I=48,K=2"],
     "argument --shape: not allowed with argument --preset"),
    (["--config", str(MIXTRAL), "--preset", "tiny"], "argument --preset: not allowed with argument --config"),
    (["--shape", "E=8,H=64,I=48,K=2", "--config", str(MIXTRAL)],
     "argument --config: not allowed with argument --shape"),
], ids=["not-json", "missing-key", "no-file", "top-k", "short", "preset+shape", "config+preset",
        "shape+config"])
def test_shape_flags_are_checked_at_parse_time(command, argv, message, tmp_path, capsys, monkeypatch):
    from moekit.bench import study

    monkeypatch.setattr(study, "measure_ceilings", lambda *a, **k: pytest.fail("started measuring"))
    files = {"bad": write(tmp_path, "{not json", "bad.json"),
             "missing": write(tmp_path, {"num_experts": 8, "hidden_size": 64, "intermediate_size": 8},
                              "missing.json")}
    argv = [a.format(**files) for a in argv]
    assert run_cli([command, *argv, "--out", str(tmp_path / "out")]) == 2
    assert message.format(**files) in error_line(capsys, f"moekit {command}")
    assert not (tmp_path / "out").exists()


# The studies on the CPU.


def test_bench_with_a_config_and_a_shape_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["bench", "--config", str(MIXTRAL), "--config", str(QWEN3), "--quick", "--tokens", "1,4",
                 "--backends", "grouped_mm,triton", "--device", "cpu", "--out", str(out)]) == 0
    rows = read_csv(out / "results.csv")
    assert [r.preset for r in rows] == ["mixtral:mixtral_tiny"] * 4 + ["qwen3_moe:qwen3_moe_tiny"] * 4
    assert all(r.status == "ok" for r in rows), [r.reason for r in rows]
    by = {r.preset: (r.num_experts, r.hidden_size, r.intermediate_size, r.top_k) for r in rows}
    assert by == {"mixtral:mixtral_tiny": (4, 64, 96, 2), "qwen3_moe:qwen3_moe_tiny": (16, 64, 32, 4)}
    report = (out / "report.md").read_text()
    assert "## mixtral:mixtral_tiny (E=4, H=64, I=96, K=2)" in report
    for stem in ("mixtral_mixtral_tiny", "qwen3_moe_qwen3_moe_tiny"):
        for plot in ("time", "floor_pct", "launches"):
            assert (out / f"{plot}_{stem}.png").stat().st_size > 0
            assert f"]({plot}_{stem}.png)" in report
    assert main(["report", str(out), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "report.md").read_text() == report

    shaped = tmp_path / "shaped"
    assert main(["bench", "--shape", "E=8,H=64,I=48,K=2,norm=0", "--quick", "--tokens", "2",
                 "--backends", "loop", "--device", "cpu", "--out", str(shaped)]) == 0
    (row,) = read_csv(shaped / "results.csv")
    assert row.preset == "shape:E=8,H=64,I=48,K=2,norm=0" and row.status == "ok"
    assert (row.num_experts, row.hidden_size, row.intermediate_size, row.top_k) == (8, 64, 48, 2)
    assert (shaped / "time_shape_E8_H64_I48_K2_norm0.png").exists()
    assert main(["report", str(shaped)]) == 0


def test_a_config_note_is_printed(tmp_path, capsys):
    path = write(tmp_path, {"model_type": "deepseek_v3", "n_routed_experts": 8, "num_experts_per_tok": 2,
                            "hidden_size": 64, "moe_intermediate_size": 32, "n_shared_experts": 1}, "ds.json")
    assert main(["bench", "--config", str(path), "--quick", "--tokens", "1", "--backends", "loop",
                 "--device", "cpu", "--out", str(tmp_path / "run")]) == 0
    printed = capsys.readouterr().out
    assert "warning:" in printed
    assert "n_shared_experts=1: shared experts are outside moekit's layer" in printed
    rows = read_csv(tmp_path / "run" / "results.csv")
    assert rows[0].preset == "deepseek_v3:ds" and rows[0].num_experts == 8


def test_imbalance_and_ep_bench_with_a_config(tmp_path):
    from moekit.bench.ep_report import STUDY as EP
    from moekit.bench.imbalance_report import STUDY as IMBALANCE

    out = tmp_path / "imb"
    assert main(["imbalance", "--config", str(MIXTRAL), "--tokens", "16", "--scenarios", "balanced",
                 "--backends", "loop", "--ep", "2", "--capacity-factors", "1", "--rep", "1", "--warmup", "0",
                 "--out", str(out)]) == 0
    rows = IMBALANCE.read(out / "results.csv")
    assert {r.preset for r in rows} == {"mixtral:mixtral_tiny"} and rows[0].num_experts == 4
    assert (out / "imbalance_one_gpu_mixtral_mixtral_tiny.png").exists()
    assert main(["report", str(out)]) == 0

    out = tmp_path / "ep"
    assert main(["ep-bench", "--simulate", "2", "--shape", "E=4,H=32,I=16,K=2", "--tokens", "8",
                 "--scenarios", "balanced", "--backends", "loop", "--rep", "1", "--warmup", "0",
                 "--out", str(out)]) == 0
    rows = EP.read(out / "results.csv")
    assert {r.preset for r in rows} == {"shape:E=4,H=32,I=16,K=2"} and rows[0].hidden_size == 32
    assert (out / "ep_shape_E4_H32_I16_K2.png").exists()
    assert main(["ep-bench", "--simulate", "8", "--shape", "E=4,H=32,I=16,K=2",
                 "--out", str(tmp_path / "x")]) == 2
