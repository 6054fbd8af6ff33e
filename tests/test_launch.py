"""`moekit._launch.launch`: Triton's per-call binding done once per specialization.

CPU: the specialization key tells apart every argument property Triton specializes on; with a
stand-in kernel (the `kernel[grid]` path recorded) and a stand-in compiled kernel, the first call of a
key takes `kernel[grid]`, later ones call the compiled launcher with every parameter in signature
order (defaults filled in), and the switch, a shadowed `run`, a launch hook, a CPU tensor (the
interpreter's launches) and an argument of another type all take `kernel[grid]`. GPU: moekit's
kernels launched directly give the same bits as through Triton, a misaligned tensor gets its own
compiled kernel, and the triton path's forward and backward are unchanged with the switch off.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from moekit import _launch


def test_spec_tells_apart_what_triton_specializes_on():
    spec = _launch._spec
    assert spec(1) != spec(2) and spec(16) != spec(17) and spec(2) == spec(3)
    assert spec(32) == spec(48) and spec(2**31) != spec(2**31 - 16) and spec(2**63) != spec(2**62)
    assert spec(-(2**31) - 16) != spec(-(2**31) + 16)
    assert spec(True) != spec(False) and spec(True) != spec(1)
    assert spec(None) != spec(0.5) and spec(0.5) == spec(2.0)
    assert spec("ieee") != spec("tf32")
    with pytest.raises(ValueError):          # a CPU tensor: never launched directly
        spec(torch.zeros(4))
    with pytest.raises(TypeError):
        spec([1, 2])


class FakeCompiled:
    def __init__(self):
        self.calls = []
        self.function, self.packed_metadata = "fn", "meta"

    def run(self, *args):
        self.calls.append(args)


def _kernel_fn(a, b, n, BLOCK, FLAG=True, OTHER=7):
    pass


class FakeKernel:
    """Enough of a JITFunction: params, signature, kernel[grid](...) returning a compiled kernel."""

    def __init__(self):
        self.signature = inspect.signature(_kernel_fn)
        self.params = [type("P", (), {"name": n})() for n in self.signature.parameters]
        self.compiled = FakeCompiled()
        self.slow = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.slow.append((grid, args, kwargs))
            return self.compiled
        return call


@pytest.fixture
def fake_cuda(monkeypatch):
    """Arguments treated as CUDA ones (their type the key), a current device and stream."""
    monkeypatch.setattr(_launch, "_spec", lambda a: (type(a), a if isinstance(a, int) else None))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_stream", lambda: 123)
    monkeypatch.delenv(_launch.FAST_LAUNCH_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _launch.clear_cache()
    yield
    _launch.clear_cache()


def test_first_call_binds_later_calls_launch_directly(fake_cuda):
    k = FakeKernel()
    _launch.launch(k, (3,), "A", "B", 5, BLOCK=64, num_warps=4)
    assert len(k.slow) == 1 and k.compiled.calls == []
    _launch.launch(k, (3, 2), "A2", "B2", 5, BLOCK=64, num_warps=4)
    assert len(k.slow) == 1
    (call,) = k.compiled.calls
    # grid, stream, function, metadata, no launch metadata or hooks, then every parameter in order
    assert call == (3, 2, 1, 123, "fn", "meta", None, None, None, "A2", "B2", 5, 64, True, 7)
    _launch.launch(k, (1,), "A", "B", 16, BLOCK=64, num_warps=4)      # a multiple of 16: its own key
    assert len(k.slow) == 2
    _launch.launch(k, (1,), "A", "B", 5, BLOCK=32, num_warps=4)       # another constexpr
    _launch.launch(k, (1,), "A", "B", 5, BLOCK=64, num_warps=8)       # another launch option
    assert len(k.slow) == 4 and len(k.compiled.calls) == 1
    _launch.launch(k, (1,), "A", "B", 5, BLOCK=32, FLAG=False, num_warps=4)
    assert len(k.slow) == 5


def test_everything_else_takes_the_triton_path(fake_cuda, monkeypatch):
    k = FakeKernel()
    for _ in range(2):
        _launch.launch(k, (1,), "A", "B", 5, BLOCK=64)
    assert len(k.slow) == 1 and len(k.compiled.calls) == 1
    monkeypatch.setenv(_launch.FAST_LAUNCH_ENV, "0")
    _launch.launch(k, (1,), "A", "B", 5, BLOCK=64)
    monkeypatch.setenv(_launch.FAST_LAUNCH_ENV, "1")
    k.run = lambda *a, **kw: None                    # a stub shadowing run (scripts/host_overhead.py)
    _launch.launch(k, (1,), "A", "B", 5, BLOCK=64)
    del k.run
    from triton import knobs
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):              # Triton 3.6 on: a HookChain, empty unless one is added
        _launch.launch(k, (1,), "A", "B", 5, BLOCK=64)
        assert len(k.compiled.calls) == 2              # the empty chain: still direct
        fn = lambda *a: None                           # noqa: E731
        hook.add(fn)
        try:
            _launch.launch(k, (1,), "A", "B", 5, BLOCK=64)
        finally:
            hook.remove(fn)
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
        _launch.launch(k, (1,), "A", "B", 5, BLOCK=64)
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
        _launch.launch(k, (1,), "A", "B", 5, BLOCK=64)
    assert len(k.slow) == 4 and len(k.compiled.calls) == 2


def test_cpu_tensors_and_unknown_arguments_take_the_triton_path(monkeypatch):
    monkeypatch.delenv(_launch.FAST_LAUNCH_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _launch.clear_cache()
    k = FakeKernel()
    for _ in range(2):
        _launch.launch(k, (1,), torch.zeros(2), torch.zeros(2), 5, BLOCK=64)
        _launch.launch(k, (1,), [1], "B", 5, BLOCK=64)
    assert len(k.slow) == 4 and k.compiled.calls == [] and not _launch._CACHE


def test_unbound_parameter_is_never_cached(fake_cuda):
    k = FakeKernel()
    for _ in range(2):
        _launch.launch(k, (1,), "A", "B", 5)          # BLOCK missing: Triton would refuse it
    assert len(k.slow) == 2 and k.compiled.calls == []


# ---- GPU -----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_direct_launches_match_triton_bitwise_gpu(monkeypatch):
    from moekit.grouped_gemm import moe_sum

    monkeypatch.delenv(_launch.FAST_LAUNCH_ENV, raising=False)
    _launch.clear_cache()
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_tokens, hidden, k, e = 37, 2048, 8, 128
    y = torch.randn(num_tokens * k, hidden, device="cuda", generator=gen).bfloat16()
    ids = torch.randint(-2, e + 2, (num_tokens, k), device="cuda", generator=gen, dtype=torch.int32)
    outs = []
    for setting in ("0", "1", "1", "1"):           # Triton, first direct-path call (binds), direct, direct
        monkeypatch.setenv(_launch.FAST_LAUNCH_ENV, setting)
        out = torch.full((num_tokens, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
        outs.append(moe_sum(y, ids, e, out))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert len(_launch._CACHE) == 1
    # A misaligned output (2 bytes in): another specialization, another kept kernel, same values.
    buf = torch.full((num_tokens * hidden + 1,), float("nan"), device="cuda", dtype=torch.bfloat16)
    odd = buf[1:].view(num_tokens, hidden)
    for _ in range(2):
        moe_sum(y, ids, e, odd)
    assert len(_launch._CACHE) == 2 and torch.equal(odd, outs[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_step_same_bits_with_the_switch_off_gpu(monkeypatch):
    from moekit.experts import moe_experts

    gen = torch.Generator(device="cuda").manual_seed(1)
    num_tokens, e, hidden, inter, k = 300, 128, 2048, 768, 8
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    gate_up = (torch.randn(e, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).bfloat16()
    down = (torch.randn(e, hidden, inter, device="cuda", generator=gen) / inter**0.5).bfloat16()
    w, ids = torch.softmax(torch.randn(num_tokens, e, device="cuda", generator=gen), -1).topk(k, -1)
    dout = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    results = []
    for setting in ("0", "1", "1"):
        monkeypatch.setenv(_launch.FAST_LAUNCH_ENV, setting)
        leaves = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
        out = moe_experts(*leaves, ids.int(), backend="triton")
        results.append((out.detach(), *torch.autograd.grad(out, leaves, dout)))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


def test_inline_key_agrees_with_spec_on_what_it_tells_apart(monkeypatch):
    """`_key` (inline, every launch) tells apart exactly what `_spec` does for ints of every width."""
    values = [0, 1, 2, 15, 16, 17, 2**31 - 16, 2**31, -(2**31), -(2**31) - 16, 2**40, 2**63, -(2**63) - 16]
    monkeypatch.setattr(_launch, "_spec", _launch._spec)
    for a in values:
        for b in values:
            same = _launch._key((a,)) == _launch._key((b,))
            assert same == (_launch._spec(a) == _launch._spec(b)), (a, b)
    with pytest.raises(ValueError):
        _launch._key((torch.zeros(1),))
