"""Gated DeltaNet anchor for issue 20's component row: FLA's chunk_gated_delta_rule (Triton) forward
and forward + backward on the shape gated_delta_rule_gpu_test times (2 x 4096 tokens packed with
cu_seqlens, 16 key heads, 32 value heads, Dk = Dv = 128; bf16 q/k/v, fp32 g/beta, no initial
state, no final state), timed with CUDA events. q and k enter already unit-norm and
use_qk_l2norm_in_kernel is off, as in our op (the layer's l2norm runs before it). FLA's source goes
under .anchors_src/fla (an ignored folder, carried to the GPU machine; FLA_SRC names another folder
holding fla/): `git --git-dir=<FLA mirror> archive HEAD fla | tar -x -C .anchors_src/`. Triton's
autotuning makes a first run take ~2 min. Run in
the same call as `gated_delta_rule_gpu_test --gtest_filter='*Qwen35BShapeTimed*'` so both rows come
from one run. Prints one `ANCHOR {...}` JSON line."""
import json
import os
import sys

import torch

from cuda_event_timing import median_ms

sys.path.insert(0, os.path.abspath(os.environ.get("FLA_SRC", ".anchors_src")))
from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: E402
import fla.ops.common.chunk_o as fla_chunk_o  # noqa: E402

# FLA refuses Triton < 3.7.1 on Hopper for its gated dq/dk/dg backward kernel (its issue 640: wrong
# results there). For a timing anchor the guard is lifted; these are timings, not a correctness claim.
fla_chunk_o.TRITON_ABOVE_3_7_1 = True


def kernel_ms(fn, label, iters=5):
    """Sum of the GPU kernel times of one call of fn (mean over iters), from torch.profiler; each
    kernel's share printed as a KERNEL line (which of FLA's stages ours should be held against)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    for event in sorted(events, key=lambda e: -e.self_device_time_total):
        print(f"KERNEL {label} {event.self_device_time_total / 1000.0 / iters:8.4f} ms  {event.key[:90]}")
    total_us = sum(event.self_device_time_total for event in events)
    return total_us / 1000.0 / iters


def main():
    seqs, seq_len, hk, hv, dk, dv = 2, 4096, 16, 32, 128, 128
    tokens = seqs * seq_len
    torch.manual_seed(0)
    dev = "cuda"
    q = torch.nn.functional.normalize(torch.randn(1, tokens, hk, dk, device=dev), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, tokens, hk, dk, device=dev), dim=-1).bfloat16()
    v = torch.randn(1, tokens, hv, dv, device=dev).bfloat16()
    g = -torch.nn.functional.softplus(torch.randn(1, tokens, hv, device=dev))  # fp32, <= 0
    beta = torch.sigmoid(torch.randn(1, tokens, hv, device=dev))               # fp32, (0, 1)
    cu_seqlens = torch.arange(0, tokens + 1, seq_len, device=dev, dtype=torch.long)
    d_o = torch.randn(1, tokens, hv, dv, device=dev).bfloat16()
    scale = dk ** -0.5
    for t in (q, k, v, g, beta):
        t.requires_grad_(True)

    def forward():
        with torch.no_grad():
            chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens)

    def forward_backward():
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens)
        torch.autograd.backward(o, d_o)
        for t in (q, k, v, g, beta):
            t.grad = None

    fwd = median_ms(forward)
    fwd_bwd = median_ms(forward_backward)
    try:
        kernels = {"kernel_forward_ms": round(kernel_ms(forward, "forward"), 4),
                   "kernel_forward_backward_ms": round(kernel_ms(forward_backward, "forward+backward"), 4)}
        kernels["kernel_backward_ms"] = round(kernels["kernel_forward_backward_ms"] -
                                              kernels["kernel_forward_ms"], 4)
    except Exception as error:  # the event times above still stand
        kernels = {"kernel_times_error": repr(error)}
    print("ANCHOR " + json.dumps({
        "op": "fla chunk_gated_delta_rule", "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__, "triton": __import__("triton").__version__,
        "shape": f"{seqs}x{seq_len} tokens, Hk {hk}, Hv {hv}, Dk {dk}, Dv {dv}",
        "forward_ms": round(fwd, 4), "forward_backward_ms": round(fwd_bwd, 4),
        "backward_ms": round(fwd_bwd - fwd, 4), **kernels}), flush=True)


if __name__ == "__main__":
    main()
