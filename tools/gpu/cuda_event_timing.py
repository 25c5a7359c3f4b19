"""The anchors' timer: the median of `iters` CUDA-event timings of fn() after `warmup` calls, in ms.
Imported by the tools/gpu/*_anchor.py scripts (run as `python3 tools/gpu/<script>.py`, which puts
this folder on the import path)."""
import torch


def median_ms(fn, iters=20, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]
