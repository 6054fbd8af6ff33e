"""The GPU fuzz's plan (`fuzz_plan`), checked on the CPU: how many Triton specialisations its default
cases compile, that every token count of a band launches the same kernels, that the pool covers the
edge cases, that a case is a function of its index, and the fuzz's own build and check on a few
small fp32 cases in the Triton interpreter.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import fuzz_plan
from fuzz_plan import BANDS, COMBOS, WARMUP_CASES, default_cases, draw_case, plain_case, specialisations
from moekit._workspace import poisoning
from moekit.tuning import SHARED_MEMORY_BUDGET, pipeline_bytes

# 101 today: per combo one GEMM1 and one GEMM2 (two where T = 1 makes S = 1, or a band takes S a
# multiple of 16), two or three moe_sum (T = 1 is compiled in), one fused align scatter per band
# but the large one, and the large band's hist, scan and scatter, or its one-launch align where S <=
# 4,096 (one-expert and top-1: 105 before the one launch became the default). At ~0.5 s a compile
# on the H200's host that is under a minute of the fuzz's 160 s.
MAX_SPECIALISATIONS = 104
MAX_PER_COMBO = 15
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_default_cases_compile_few_specialisations_and_all_in_the_first_rounds():
    cases = default_cases()
    keys = specialisations(cases, DEVICE)
    seen: set = set()
    per_combo = collections.defaultdict(set)
    for case, launched in zip(cases, keys):
        assert case.num_tokens == 0 or launched, case.describe()
        if case.index >= WARMUP_CASES:
            assert launched <= seen, f"{case.describe()} compiles {sorted(k[0] for k in launched - seen)}"
        seen |= launched
        per_combo[case.combo.name] |= launched
    by_kernel = collections.Counter(k[0] for k in seen)
    assert len(seen) <= MAX_SPECIALISATIONS, f"{len(seen)} specialisations: {dict(by_kernel)}"
    assert max(len(v) for v in per_combo.values()) <= MAX_PER_COMBO, {n: len(v) for n, v in per_combo.items()}
    assert set(by_kernel) == {n for names in fuzz_plan.KERNELS.values() for n in names}


def test_every_token_count_of_a_band_launches_the_same_kernels():
    for combo in COMBOS:
        for name, tokens in zip(BANDS, combo.bands, strict=True):
            launched = specialisations([plain_case(combo, t) for t in tokens], DEVICE)
            for t, keys in zip(tokens, launched):
                if t == 0:
                    assert not keys, f"{combo.name}: T = 0 launched {keys}"
                else:
                    assert keys == launched[0], f"{combo.name}, band {name}: T = {t} vs T = {tokens[0]}"


def test_the_pool_covers_the_edge_cases():
    def has(pred):
        return any(pred(c) for c in COMBOS)

    assert has(lambda c: c.num_experts == 1) and has(lambda c: c.num_experts > 256)
    assert has(lambda c: c.top_k == 1) and has(lambda c: c.top_k == c.num_experts > 1)
    assert has(lambda c: c.top_k > c.num_experts)                       # an expert-parallel rank
    assert {c.dtype for c in COMBOS} == {torch.float32, torch.float16, torch.bfloat16}
    assert {c.ids_dtype for c in COMBOS} == {torch.int32, torch.int64}
    assert {c.config.pair_blocks for c in COMBOS} == {1, 2}
    assert {c.x_pad > 0 for c in COMBOS} == {True, False}              # strided and contiguous x
    assert has(lambda c: c.hidden >= 2048) and has(lambda c: c.weights_dtype != torch.float32)
    assert has(lambda c: c.hidden % 16 and c.inter % 16)                # sizes off every tile
    assert {c.hidden % c.config.block_k1 == 0 for c in COMBOS} == {True, False}   # EVEN_K both ways
    for combo in COMBOS:
        tokens = {t for band in combo.bands for t in band}
        assert {0, 1} <= tokens and max(tokens) > 2048, combo.name      # T = 0, 1, multi-chunk align
        assert any(t > 2 and all(t % p for p in range(2, t)) for t in tokens), combo.name   # a prime T


def test_combo_tiles_fit_the_shared_memory():
    for combo in COMBOS:
        for gemm in (1, 2):
            used = pipeline_bytes(combo.config, combo.dtype.itemsize, gemm)
            assert used <= SHARED_MEMORY_BUDGET, f"{combo.name} GEMM{gemm}: {used} bytes"


def test_a_case_is_a_function_of_its_index():
    cases = default_cases(60)
    assert [draw_case(i) for i in reversed(range(60))] == cases[::-1]
    for case in cases[:WARMUP_CASES]:                                   # round robin, bands in turn
        combo = COMBOS[case.index % len(COMBOS)]
        band = case.index // len(COMBOS)
        assert case.combo == combo and case.band == BANDS[band] and case.num_tokens == combo.bands[band][0]
    text = cases[7].describe()
    for part in ("case 7:", "E=", "H=", "I=", "K=", "T=", "routing=", "invalid=", "ExpertsConfig("):
        assert part in text
    drawn = default_cases()
    for field, values in (("routing", fuzz_plan.ROUTINGS), ("weights", fuzz_plan.WEIGHTS), ("band", BANDS)):
        assert {getattr(c, field) for c in drawn} == set(values), field
    for flag in ("nan_row", "out_buffer", "strided_routing", "ignore_invalid_ids"):
        assert {getattr(c, flag) for c in drawn} == {True, False}, flag
    assert {c.invalid for c in drawn} == {0.0, 0.1, 0.5, 1.0}


def test_triton_spec_matches_triton():
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.nvidia.compiler import CUDABackend
    except ImportError:
        pytest.skip("this Triton has no native_specialize_impl")
    x = torch.empty(64)
    for arg in (0, 1, 2, 16, 17, 48, 2**31 - 1, 2**31, 2**40, -16, 0.5, True, x, x[1:], x[4:]):
        triton_key = native_specialize_impl(CUDABackend, arg, False, True, True)
        ours = fuzz_plan.triton_spec(arg)
        if isinstance(arg, torch.Tensor):
            assert triton_key[1] == ours[1], arg                        # the alignment flag
        else:
            assert tuple(triton_key) == ours, arg


def test_fuzz_cases_pass_on_the_interpreter():
    """The fuzz's build and check on the CPU (fp32: the interpreter rounds bf16 stores toward zero), small
    T: every routing, invalid ids, a NaN row, out=, column-major routing tensors, int64 wrap-arounds."""
    primes = next(c for c in default_cases() if c.combo.name == "primes" and c.band == "tiny")
    wide = next(c for c in default_cases() if c.combo.name == "top-k-equals-E" and c.band == "tiny")
    cache: dict = {}
    with torch.no_grad(), poisoning():
        for i, routing in enumerate(fuzz_plan.ROUTINGS):
            case = dataclasses.replace(
                primes, num_tokens=7, routing=routing, invalid=(0.0, 0.5)[i % 2], ignore_invalid_ids=True,
                weights=fuzz_plan.WEIGHTS[i], nan_row=i == 1, out_buffer=i % 2 == 0, strided_routing=i >= 3,
                seed=i)
            fuzz_plan.run_case(case, "cpu", cache)
        wrapping = dataclasses.replace(wide, num_tokens=9, invalid=0.5, ignore_invalid_ids=True)   # int64 ids
        fuzz_plan.run_case(wrapping, "cpu")
