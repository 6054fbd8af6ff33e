"""FP8 experts as Transformers' FineGrainedFP8 lays them out, on moekit: the loader helpers
(`moekit.quant.loading`, `Fp8Weight.from_checkpoint`) and a tiny random Qwen3-MoE (hidden 128,
moe_intermediate 128, 4 experts, top-2, 2 layers) whose experts are FP8, run with
experts_implementation="moekit".

How the FP8 model is built: Transformers quantizes only in `from_pretrained`, and without a CUDA or
XPU device its FP8 quantizer refuses to quantize (and dequantizes a pre-quantized checkpoint to
bf16); `from_config` with a `quantization_config` builds a dense model. So `fp8_model` runs the
loader's two steps itself: `replace_with_fp8_linear` (the quantizer's module swap: every `*.experts`
becomes `FP8Experts`; the attention projections and lm_head stay dense through
modules_to_not_convert, since FP8Linear needs the hub's kernels), then the loader's own quantizing
op (`Fp8Quantize`) on each module's dense weights, the results set as its Parameters
(gate_up_proj / gate_up_proj_scale_inv / down_proj / down_proj_scale_inv).

The oracle is never Transformers' FP8 path (it needs CUDA kernels) nor moekit: REFERENCE, an
experts implementation registered in both registries, computes from the module's own tensors in
fp32 in plain PyTorch what block-scaled w8a8 FP8 experts compute (weights times their 128 x 128
block scales; activations and h quantized to e4m3 per token per 128 channels, scale amax / 448).
fp32 logits match it to 1e-5 relative; bf16 logits within 2x the error of PLAIN, the same
arithmetic in bf16.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from helpers import rel_err
from moekit.quant import FP8_DTYPE, Fp8Weight, quantize_experts
from moekit.quant.loading import experts_from_checkpoint, fp8_weight, stack_experts

transformers = pytest.importorskip("transformers", minversion="5.0")

from transformers.integrations.finegrained_fp8 import (  # noqa: E402
    FP8Experts,
    FP8ExpertsInterface,
    Fp8Quantize,
    replace_with_fp8_linear,
)
from transformers.integrations.moe import ExpertsInterface  # noqa: E402

from moekit.integrations import transformers as mt  # noqa: E402
from moekit.integrations.transformers import experts as mt_experts  # noqa: E402
from moekit.integrations.transformers import fp8 as mt_fp8  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K, VOCAB = 128, 128, 4, 2, 128
REFERENCE, PLAIN = "fp8-fp32-reference", "fp8-plain-same-dtype"
DENSE_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]
E4M3_MAX = 448.0


# ---- plain PyTorch FP8 arithmetic (no moekit code): the oracle and the 2x rule's baseline


def dequant(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(E, N, K) fp32: every 128 x 128 block of weight times its scale."""
    s = scale.float().repeat_interleave(128, 1).repeat_interleave(128, 2)
    return weight.float() * s


def quant_rows(v: torch.Tensor) -> torch.Tensor:
    """v (T, K) quantized to e4m3 per row per 128 columns and back, fp32."""
    t, k = v.shape
    g = v.float().reshape(t, k // 128, 128)
    s = (g.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=1e-10 / E4M3_MAX)
    return ((g / s).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).float() * s).reshape(t, k)


def fp8_experts_plain(experts, hidden_states, top_k_index, top_k_weights, *, dtype=torch.float32,
                      quantize_activations=True):
    """The FP8 experts in dtype from the module's tensors; ids outside [0, E) give 0."""
    wg = dequant(experts.gate_up_proj, experts.gate_up_proj_scale_inv).to(dtype)
    wd = dequant(experts.down_proj, experts.down_proj_scale_inv).to(dtype)
    q = quant_rows if quantize_activations else (lambda v: v)
    x, ids, inter = q(hidden_states).to(dtype), top_k_index.long(), wd.shape[2]
    out = torch.zeros(x.shape[0], wd.shape[1], dtype=dtype, device=x.device)
    for e in range(wg.shape[0]):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        a = x[tok] @ wg[e].T
        h = q(F.silu(a[:, :inter]) * a[:, inter:]).to(dtype)
        out = out.index_add(0, tok, (h @ wd[e].T) * top_k_weights[tok, slot].to(dtype)[:, None])
    return out.to(hidden_states.dtype)


def reference_experts(experts, hidden_states, top_k_index, top_k_weights):
    return fp8_experts_plain(experts, hidden_states, top_k_index, top_k_weights)


def plain_experts(experts, hidden_states, top_k_index, top_k_weights):
    return fp8_experts_plain(experts, hidden_states, top_k_index, top_k_weights, dtype=hidden_states.dtype)


@pytest.fixture(scope="module", autouse=True)
def registered():
    for interface in (ExpertsInterface, FP8ExpertsInterface):
        interface.register(REFERENCE, reference_experts)
        interface.register(PLAIN, plain_experts)
    return mt.register()


# ---- the tiny FP8 model


def tiny_config(**overrides):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32, intermediate_size=256, moe_intermediate_size=INTER, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def fp8_quantize(tensors: dict, scale_fmt: str = "float") -> dict:
    """Transformers' loader op on dense tensors: {key: e4m3, key_scale_inv (or .weight_scale_inv)}."""
    qcfg = transformers.FineGrainedFP8Config(weight_block_size=[128, 128], scale_fmt=scale_fmt)
    return Fp8Quantize(types.SimpleNamespace(quantization_config=qcfg)).convert(dict(tensors))


def fp8_model(dtype=torch.float32, *, scale_fmt="float", device="cpu", **overrides):
    """The tiny Qwen3-MoE with FineGrainedFP8 experts, as from_pretrained with a quantization_config
    would make it (module docstring), experts_implementation="moekit", eval mode."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(**overrides),
                                                          experts_implementation="moekit")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():        # experts that move the logits
            if name.endswith(("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model.to(device, dtype)
    dense = {n: (m.gate_up_proj.detach(), m.down_proj.detach()) for n, m in model.named_modules()
             if n.endswith(".experts")}
    qcfg = transformers.FineGrainedFP8Config(weight_block_size=[128, 128], scale_fmt=scale_fmt,
                                             modules_to_not_convert=DENSE_MODULES)
    replace_with_fp8_linear(model, modules_to_not_convert=DENSE_MODULES, quantization_config=qcfg)
    model.config.quantization_config = qcfg
    for name, module in model.named_modules():
        if name in dense:
            assert isinstance(module, FP8Experts)
            state = fp8_quantize({"gate_up_proj": dense[name][0], "down_proj": dense[name][1]}, scale_fmt)
            for key, t in state.items():
                setattr(module, key, nn.Parameter(t, requires_grad=t.is_floating_point()))
    return model.eval()


def fp8_experts(model) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, FP8Experts)]


def input_ids(batch: int = 2, seq_len: int = 7, device="cpu") -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(1)).to(device)


def logits(model, ids, implementation: str) -> torch.Tensor:
    model.set_experts_implementation(implementation)
    with torch.no_grad():
        return model(ids).logits


def moekit_ran(fn):
    """fn()'s result and whether moekit's FP8 path (moe_experts on Fp8Weights) ran during it."""
    calls, real = [], mt_fp8.moe_experts

    def spy(x, gate_up, down, *args, **kwargs):
        calls.append(isinstance(gate_up, Fp8Weight) and isinstance(down, Fp8Weight))
        return real(x, gate_up, down, *args, **kwargs)

    with mock.patch.object(mt_fp8, "moe_experts", spy):
        out = fn()
    return out, bool(calls) and all(calls)


# ---- the model on moekit


def test_the_fp8_model_has_transformers_fp8_layout():
    model = fp8_model()
    for experts in fp8_experts(model):
        assert experts.gate_up_proj.dtype == FP8_DTYPE
        assert experts.gate_up_proj.shape == (EXPERTS, 2 * INTER, HIDDEN)
        assert experts.gate_up_proj_scale_inv.dtype == torch.float32
        assert experts.gate_up_proj_scale_inv.shape == (EXPERTS, 2 * INTER // 128, HIDDEN // 128)
        assert experts.down_proj.shape == (EXPERTS, HIDDEN, INTER)
        assert experts.down_proj_scale_inv.shape == (EXPERTS, HIDDEN // 128, INTER // 128)
        assert experts.block_size == [128, 128] and not experts.is_transposed
        assert mt.unsupported_reason(experts) is None
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_logits_match_the_fp32_oracle(dtype):
    model = fp8_model(dtype)
    ids = input_ids()
    ref = logits(model, ids, REFERENCE)
    plain = logits(model, ids, PLAIN)
    model.set_experts_implementation("moekit")
    mt_experts._warned.clear()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="moekit: .* running Transformers'")    # no fallback
        out, ran = moekit_ran(lambda: model(ids).logits)
    assert ran and out.dtype == dtype
    if dtype == torch.float32:
        assert rel_err(out, ref) <= 1e-5
    else:
        bound = 2 * rel_err(plain, ref)
        assert math.isfinite(bound) and rel_err(out, ref) <= bound
    with torch.no_grad():                               # sensitivity: the experts move the logits
        for experts in fp8_experts(model):
            experts.down_proj_scale_inv.mul_(0.5)
    assert rel_err(logits(model, ids, REFERENCE), ref) > 1e-2


def test_ue8m0_scales_are_converted_once_and_cached():
    """scale_fmt="ue8m0": Transformers stores float8_e8m0fnu scales; moekit converts them to float32
    once per module (exactly: powers of two), rebuilds after an in-place change, and wraps float32
    scales without a copy."""
    model = fp8_model(scale_fmt="ue8m0")
    experts = fp8_experts(model)[0]
    assert experts.gate_up_proj_scale_inv.dtype == torch.float8_e8m0fnu
    ids = input_ids()
    ref = logits(model, ids, REFERENCE)
    model.set_experts_implementation("moekit")
    with torch.no_grad():
        out, ran = moekit_ran(lambda: model(ids).logits)
    assert ran and rel_err(out, ref) <= 1e-5
    gate_up, down = mt_fp8._wrappers(experts)
    assert mt_fp8._wrappers(experts)[0] is gate_up                  # cached
    assert gate_up.data.data_ptr() == experts.gate_up_proj.data_ptr()
    assert torch.equal(gate_up.scale, experts.gate_up_proj_scale_inv.float())
    with torch.no_grad():
        experts.down_proj_scale_inv.copy_((experts.down_proj_scale_inv.float() * 2).to(torch.float8_e8m0fnu))
    assert torch.equal(mt_fp8._wrappers(experts)[1].scale, down.scale * 2)
    fp32 = fp8_experts(fp8_model())[0]
    gate_up, down = mt_fp8._wrappers(fp32)
    assert gate_up.scale.data_ptr() == fp32.gate_up_proj_scale_inv.data_ptr()   # no copy
    assert down.data.data_ptr() == fp32.down_proj.data_ptr()


def test_sentinel_ids_contribute_nothing():
    """Expert parallelism marks non-local experts with id E: such a pair adds exactly 0."""
    experts = fp8_experts(fp8_model())[0]
    x = torch.randn(5, HIDDEN)
    ids = torch.tensor([[0, 1], [2, EXPERTS], [EXPERTS, EXPERTS], [3, 0], [1, EXPERTS]])
    w = torch.rand(5, TOP_K)
    with torch.no_grad():
        out = mt_experts.experts_forward(experts, x, ids, w)
        noisy = mt_experts.experts_forward(experts, x, ids, torch.where(ids == EXPERTS, 7.0, w))
    assert torch.equal(out, noisy) and torch.equal(out[2], torch.zeros(HIDDEN))
    assert rel_err(out, reference_experts(experts, x, ids, w)) <= 1e-5


def test_compiled_fp8_experts_match_eager():
    """Under torch.compile the call is the moekit::experts_fp8 op on the module's tensors."""
    experts = fp8_experts(fp8_model(scale_fmt="ue8m0"))[0]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x, i, w: mt_experts.experts_forward(experts, x, i, w), backend=counter,
                             fullgraph=True, dynamic=True)
    for tokens in (3, 9):
        x = torch.randn(tokens, HIDDEN)
        ids = torch.randint(0, EXPERTS, (tokens, TOP_K))
        w = torch.rand(tokens, TOP_K)
        with torch.no_grad():
            assert torch.equal(compiled(x, ids, w), mt_experts.experts_forward(experts, x, ids, w))
    assert counter.frame_count == 1


def test_register_adds_moekit_to_the_fp8_registry(registered):
    assert FP8ExpertsInterface().get_interface("moekit", None) is registered
    assert ExpertsInterface().get_interface("moekit", None) is registered
    fp8_only = set(FP8ExpertsInterface._global_mapping) - set(ExpertsInterface._global_mapping)
    assert fp8_only                                     # deepgemm_megamoe, at least
    for name in fp8_only:
        with pytest.raises(ValueError, match="Transformers' own"):
            mt.register(name)


def test_from_transformers_refuses_fp8_experts():
    block = fp8_model().model.layers[0].mlp
    with pytest.raises(ValueError, match="FP8 weights"):
        mt.from_transformers(block)


# ---- what moekit leaves to Transformers


def _spy_fallback():
    calls = []

    def spy(experts, hidden_states, top_k_index, top_k_weights):
        calls.append(type(experts).__name__)
        return reference_experts(experts, hidden_states, top_k_index, top_k_weights)

    tf = dataclasses.replace(mt_experts._transformers(), fp8_grouped_mm_forward=spy)
    return calls, mock.patch.object(mt_experts, "_TF", tf)


@pytest.mark.parametrize("change,reason", [
    (dict(activation_scheme="static"), "activation_scheme='static'"),
    (dict(block_size=[64, 64]), r"weight_block_size \[64, 64\]"),
    (dict(swiglu_alpha=1.702, swiglu_limit=7.0, limit=7.0), "swiglu_alpha=1.702"),
    (dict(is_transposed=True), "transposed FP8 weights"),
    (dict(has_gate=False), "non-gated"),
    (dict(act_fn=nn.GELU()), "activation GELU"),
], ids=["static", "block64", "swiglu-oai", "transposed", "no-gate", "gelu"])
def test_unservable_fp8_modules_say_why(change, reason):
    experts = fp8_experts(fp8_model())[0]
    for k, v in change.items():
        setattr(experts, k, v)
    assert mt.unsupported_reason(experts) is not None
    assert mt_experts._plan(experts)[0] is not None
    assert re.search(reason, mt.unsupported_reason(experts))


def test_fp8_shapes_moekit_cannot_block_say_why():
    """I = 64: Transformers pads the 128-row scale blocks (cdiv), moekit takes whole blocks only."""
    experts = fp8_experts(fp8_model())[0]
    experts.down_proj = nn.Parameter(experts.down_proj[:, :, :64].contiguous(), requires_grad=False)
    assert "down_proj: moekit's FP8 experts need" in mt.unsupported_reason(experts)
    experts = fp8_experts(fp8_model())[0]
    experts.gate_up_proj_scale_inv = nn.Parameter(experts.gate_up_proj_scale_inv[:, :1], requires_grad=False)
    assert "gate_up_proj_scale_inv must have shape (4, 2, 1)" in mt.unsupported_reason(experts)


def test_fallbacks_run_transformers_fp8_path_with_one_warning():
    model = fp8_model()
    ids = input_ids()
    ref = logits(model, ids, REFERENCE)
    for experts in fp8_experts(model):
        experts.activation_scheme = "static"            # Transformers' eager loop: selected, not run
        name, forward = mt_fp8.fp8_fallback(experts, mt_experts._transformers())
        assert name == "eager FP8" and forward.__qualname__ == "FP8Experts.forward"
        experts.activation_scheme = "dynamic"
    model.set_experts_implementation("moekit")
    calls, patch = _spy_fallback()
    mt_experts._warned.clear()
    with patch, pytest.warns(UserWarning, match="inputs that need gradients") as record:
        out = model(ids).logits                         # grad mode on: the embeddings require grad
    messages = [str(r.message) for r in record if "moekit" in str(r.message)]
    assert len(messages) == 1 and "Transformers' FP8 grouped_mm experts instead" in messages[0]
    assert calls == ["FP8Experts", "FP8Experts"]
    assert rel_err(out, ref) <= 1e-5
    registered = mt.register("moekit-grouped-mm", backend="grouped_mm")
    experts = fp8_experts(model)[0]
    x, top = torch.randn(3, HIDDEN), torch.tensor([[0, 1], [2, 3], [1, 2]])
    calls, patch = _spy_fallback()
    with patch, torch.no_grad(), pytest.warns(UserWarning, match="backend='grouped_mm' does not take"):
        registered(experts, x, top, torch.rand(3, 2))
    assert calls == ["FP8Experts"]


def test_nan_scale_raises_naming_the_module():
    model = fp8_model()
    experts = fp8_experts(model)[1]
    with torch.no_grad():
        experts.down_proj_scale_inv[2, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"FP8Experts\.down_proj_scale_inv must be finite and positive, got "
                                         r"nan at \(2, 0, 0\)"):
        logits(model, input_ids(), "moekit")


# ---- the loader helpers


def dense_experts(num_experts=3, inter=256, hidden=384):
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(num_experts, inter, hidden, generator=gen) for _ in range(2))
    return gate, up, torch.randn(num_experts, hidden, inter, generator=gen)


def per_expert_checkpoint(prefix="model.layers.0.mlp.experts", scale_fmt="float"):
    """DeepSeek-V3 / Qwen3-FP8 naming, quantized by Transformers' loader op per expert."""
    gate, up, down = dense_experts()
    dense = {f"{prefix}.{e}.{p}.weight": w[e] for e in range(gate.shape[0])
             for p, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down))}
    return fp8_quantize(dense, scale_fmt), (gate, up, down)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_experts_from_per_expert_tensors(scale_fmt):
    ckpt, (gate, up, down) = per_expert_checkpoint(scale_fmt=scale_fmt)
    assert ckpt["model.layers.0.mlp.experts.1.up_proj.weight_scale_inv"].shape == (2, 3)
    gate_up, dn = experts_from_checkpoint(ckpt, "model.layers.0.mlp.experts")
    assert gate_up.shape == (3, 512, 384) and gate_up.scale.shape == (3, 4, 3)
    assert gate_up.scale.dtype == torch.float32
    assert dn.shape == (3, 384, 256) and dn.scale.shape == (3, 3, 2)
    def bits(t):
        return t.view(torch.uint8)

    for e in range(3):
        key = f"model.layers.0.mlp.experts.{e}"
        assert torch.equal(bits(gate_up.data[e, :256]), bits(ckpt[f"{key}.gate_proj.weight"]))
        assert torch.equal(bits(gate_up.data[e, 256:]), bits(ckpt[f"{key}.up_proj.weight"]))
        assert torch.equal(gate_up.scale[e, :2], ckpt[f"{key}.gate_proj.weight_scale_inv"].float())
        assert torch.equal(gate_up.scale[e, 2:], ckpt[f"{key}.up_proj.weight_scale_inv"].float())
        assert torch.equal(bits(dn.data[e]), bits(ckpt[f"{key}.down_proj.weight"]))
        assert torch.equal(dn.scale[e], ckpt[f"{key}.down_proj.weight_scale_inv"].float())
    # the weight_scale_inv convention: w ~= data * scale_inv, to e4m3's 2^-4 relative per element
    err = (gate_up.dequantize() - torch.cat([gate, up], 1)).abs() / torch.cat([gate, up], 1).abs()
    assert float(err[torch.cat([gate, up], 1).abs() > 1e-2].max()) <= 2.0**-4
    assert rel_err(dn.dequantize(), down) < 0.04


def test_experts_from_fused_tensors_wrap_without_a_copy():
    experts = fp8_experts(fp8_model())[0]
    state = {f"model.layers.0.mlp.experts.{k}": v for k, v in experts.state_dict().items()}
    gate_up, down = experts_from_checkpoint(state, "model.layers.0.mlp.experts.")
    assert gate_up.data.data_ptr() == experts.gate_up_proj.data_ptr()
    assert gate_up.scale.data_ptr() == experts.gate_up_proj_scale_inv.data_ptr()
    assert down.shape == (EXPERTS, HIDDEN, INTER)
    assert down.scale.data_ptr() == experts.down_proj_scale_inv.data_ptr()
    same = Fp8Weight.from_checkpoint(experts.gate_up_proj, experts.gate_up_proj_scale_inv)
    assert same.data is experts.gate_up_proj and same.scale is experts.gate_up_proj_scale_inv
    stacked = stack_experts(list(experts.down_proj), list(experts.down_proj_scale_inv))
    assert torch.equal(stacked.data.view(torch.uint8), experts.down_proj.view(torch.uint8))
    assert torch.equal(stacked.scale, experts.down_proj_scale_inv)


def test_loader_bad_inputs_raise_naming_the_tensor():
    ckpt, _ = per_expert_checkpoint(prefix="experts")
    missing = dict(ckpt)
    del missing["experts.2.up_proj.weight_scale_inv"]
    with pytest.raises(KeyError, match=r"experts\.2\.up_proj\.weight_scale_inv"):
        experts_from_checkpoint(missing, "experts")
    with pytest.raises(KeyError, match="no FP8 experts under prefix 'nope'"):
        experts_from_checkpoint(ckpt, "nope")
    gap = {k: v for k, v in ckpt.items() if not k.startswith("experts.1.")}     # experts 0 and 2 only
    with pytest.raises(KeyError, match=r"expert 1 gate_proj: the checkpoint has no 'experts\.1\.gate_proj"):
        experts_from_checkpoint(gap, "experts")
    no_gate = {k: v for k, v in ckpt.items() if not k.startswith("experts.0.gate_proj")}
    with pytest.raises(KeyError, match=r"experts\.0\.gate_proj\.weight'"):
        experts_from_checkpoint(no_gate, "experts")
    wrong = dict(ckpt, **{"experts.1.gate_proj.weight_scale_inv": torch.ones(2, 4)})
    with pytest.raises(ValueError, match=r"experts\.1\.gate_proj\.weight_scale_inv must have shape \(2, 3\)"):
        experts_from_checkpoint(wrong, "experts")
    bf16 = dict(ckpt, **{"experts.0.down_proj.weight": torch.zeros(384, 256, dtype=torch.bfloat16)})
    with pytest.raises(TypeError, match=r"experts\.0\.down_proj\.weight must be a 2-D float8_e4m3fn .*"
                                        r"bfloat16.*quantize_experts"):
        experts_from_checkpoint(bf16, "experts")
    nan = dict(ckpt)
    nan["experts.1.up_proj.weight_scale_inv"] = ckpt["experts.1.up_proj.weight_scale_inv"].clone()
    nan["experts.1.up_proj.weight_scale_inv"][1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"experts\.1\.up_proj\.weight_scale_inv must be finite and "
                                         r"positive, got nan at \(1, 2\)"):
        experts_from_checkpoint(nan, "experts")
    neg = dict(ckpt)
    neg["experts.0.down_proj.weight_scale_inv"] = -ckpt["experts.0.down_proj.weight_scale_inv"]
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj\.weight_scale_inv must be finite and pos"):
        experts_from_checkpoint(neg, "experts")


def test_fused_loader_bad_inputs_raise_naming_the_argument():
    w = quantize_experts(torch.randn(2, 256, 128))
    with pytest.raises(TypeError, match=r"gate_up_proj must be a 3-D float8_e4m3fn .*torch\.bfloat16"):
        fp8_weight(w.data.float().bfloat16(), w.scale, name="gate_up_proj")
    with pytest.raises(ValueError, match=r"gate_up_proj_scale_inv must have shape \(2, 2, 1\)"):
        fp8_weight(w.data, w.scale[:, :1], name="gate_up_proj")
    with pytest.raises(TypeError, match="weight_scale_inv must be a float32"):
        Fp8Weight.from_checkpoint(w.data, w.scale.to(torch.int32))
    bad = w.scale.clone()
    bad[1, 1, 0] = float("inf")
    with pytest.raises(ValueError, match=r"down_proj_scale_inv must be finite and positive, got inf at "
                                         r"\(1, 1, 0\)"):
        fp8_weight(w.data, bad, name="down_proj")
    with pytest.raises(KeyError, match="experts.down_proj_scale_inv"):
        experts_from_checkpoint({"experts.gate_up_proj": w.data, "experts.gate_up_proj_scale_inv": w.scale,
                                 "experts.down_proj": w.data}, "experts")
    with pytest.raises(ValueError, match=r"down_proj must have shape \(E, H, I\) = \(2, 128, 128\)"):
        experts_from_checkpoint({"gate_up_proj": w.data, "gate_up_proj_scale_inv": w.scale,
                                 "down_proj": w.data, "down_proj_scale_inv": w.scale})
    with pytest.raises(ValueError, match="divisible by 128"):
        fp8_weight(torch.zeros(2, 192, 128, dtype=FP8_DTYPE), torch.ones(2, 2, 1))


# ---- the GPU: the triton backend on real e4m3


@pytest.mark.gpu
def test_fp8_model_on_cuda_through_triton():
    model = fp8_model(torch.bfloat16, device="cuda")
    ids = input_ids(batch=4, seq_len=16, device="cuda")          # 64 tokens: the grouped w8a8 path
    ref = logits(model, ids, REFERENCE)
    plain = logits(model, ids, PLAIN)
    model.set_experts_implementation("moekit")
    mt_experts._warned.clear()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="moekit: .* running Transformers'")    # no fallback
        out, ran = moekit_ran(lambda: model(ids).logits)
    assert ran
    assert rel_err(out, ref) <= 2 * rel_err(plain, ref)
    # one token: the decode kernels, w8a16 (activations in bf16), replayed from an eager graph
    experts = fp8_experts(model)[0]
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    top, w = torch.tensor([[1, 3]], device="cuda"), torch.rand(1, 2, device="cuda")
    with torch.no_grad():
        outs = [mt_experts.experts_forward(experts, x, top, w) for _ in range(3)]
    ref16 = fp8_experts_plain(experts, x, top, w, quantize_activations=False)
    plain16 = fp8_experts_plain(experts, x, top, w, dtype=torch.bfloat16, quantize_activations=False)
    assert torch.equal(outs[1], outs[2])
    assert rel_err(outs[2], ref16) <= max(2 * rel_err(plain16, ref16), 1e-2)
