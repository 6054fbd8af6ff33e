"""Training step: isolated (L2 flushed, synced before) vs back-to-back, and host time per step."""
import os, statistics, sys, time, torch
sys.path.insert(0, "scripts")
import kernel_breakdown as kb
from moekit.bench.timing import CacheFlusher
dev = torch.device("cuda")
print("alloc conf:", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"))
for T in (1024, 4096, 16384):
    step = kb._call("triton", True, *kb._inputs("qwen3-30b-a3b", T, torch.bfloat16, dev))
    for _ in range(5): step()
    torch.cuda.synchronize()
    fl = CacheFlusher(dev)
    iso = []
    for _ in range(10):
        fl.flush() if hasattr(fl, "flush") else fl()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); step(); e.record(); torch.cuda.synchronize(); iso.append(s.elapsed_time(e))
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = []
    s.record()
    for _ in range(20):
        t0 = time.perf_counter(); step(); host.append((time.perf_counter() - t0) * 1e3)
    e.record(); torch.cuda.synchronize()
    b2b = s.elapsed_time(e) / 20
    # host time with the GPU idle-ish: one step after a sync (launch-to-return)
    hs = []
    for _ in range(5):
        torch.cuda.synchronize(); t0 = time.perf_counter(); step(); hs.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    print(f"T={T}: isolated median {statistics.median(iso):.3f} ms; back-to-back {b2b:.3f} ms/step; "
          f"host per step (b2b) median {statistics.median(host):.3f} ms; host after sync {statistics.median(hs):.3f} ms",
          flush=True)
