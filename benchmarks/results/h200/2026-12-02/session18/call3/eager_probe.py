"""Where an eager MoELayer call's host time goes at T=1/4 (decision probe, session 18)."""
import time, torch, moekit, statistics
from moekit.eager_graphs import graph_cache, eligible, copy_in, _autocast_state
from moekit.bench.timing import time_fn
dev = torch.device("cuda")
torch.manual_seed(0)
layer = moekit.MoELayer("qwen3-30b-a3b", dtype=torch.bfloat16, device=dev).requires_grad_(False)
def host(f, n=2000):
    s = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns(); f(); s.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return statistics.median(s) / 1e3
for T in (1, 4, 16):
    x = torch.randn(T, 2048, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x); layer(x); torch.cuda.synchronize()
        cache = graph_cache(layer)
        key = layer._graph_key()
        full = (key, tuple((tuple(t.shape), t.dtype, t.device) for t in (x,)), _autocast_state())
        e = cache._entries[full]
        r = {}
        r["forward (host)"] = host(lambda: layer(x))
        r["nn call -> forward body"] = host(lambda: layer.forward(x))
        r["_graphable"] = host(lambda: layer._graphable(x))
        r["graph_key+cache"] = host(lambda: (graph_cache(layer), layer._graph_key()))
        r["full key + get"] = host(lambda: cache._entries.get((key, tuple((tuple(t.shape), t.dtype, t.device) for t in (x,)), _autocast_state())))
        r["copy_in"] = host(lambda: copy_in(e.inputs, e.input_bytes, (x,)))
        r["replay"] = host(lambda: e.graph.replay())
        r["clone"] = host(lambda: e.output.clone())
        r["empty_like"] = host(lambda: torch.empty_like(e.output))
        iso = {}
        iso["eager layer"] = time_fn(lambda: layer(x), device=dev).median_ms * 1e3
        iso["copy+replay+clone"] = time_fn(lambda: (copy_in(e.inputs, e.input_bytes, (x,)), e.graph.replay(), e.output.clone()), device=dev).median_ms * 1e3
        iso["replay+clone"] = time_fn(lambda: (e.graph.replay(), e.output.clone()), device=dev).median_ms * 1e3
        iso["replay"] = time_fn(lambda: e.graph.replay(), device=dev).median_ms * 1e3
        iso["layer graph (bench)"] = time_fn(lambda: layer(x), graph=True, device=dev).median_ms * 1e3
    print(f"T={T} host µs: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()))
    print(f"T={T} isolated µs: " + ", ".join(f"{k} {v:.1f}" for k, v in iso.items()), flush=True)
