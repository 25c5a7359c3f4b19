"""Attention anchor for issue 20's component row: PyTorch's fused SDPA (cuDNN backend, and flash for
reference) forward + backward on the text model's attention shapes (causal, 16 query heads, 2 KV
heads repeated as transformers does, head dim 256, bf16), timed with CUDA events. Run on the GPU
machine in the same call as `cudnn_sdpa_gpu_test --gtest_filter='*Timing*'` so both rows come from
one run. Prints one `ANCHOR {...}` JSON line per shape and backend."""
import json
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_ms(fn, iters=20, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def run(batch, seq, backend):
    hq, hkv, d = 16, 2, 256
    q = torch.randn(batch, hq, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, hkv, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch, hkv, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(batch, hq, seq, d, device="cuda", dtype=torch.bfloat16)

    def forward():
        kk = k.repeat_interleave(hq // hkv, dim=1)
        vv = v.repeat_interleave(hq // hkv, dim=1)
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True)

    def fwd_bwd():
        out = forward()
        out.backward(grad)

    with torch.no_grad():
        fwd = time_ms(forward)
    total = time_ms(fwd_bwd)
    # Causal: half of the 4 * S^2 * D products per head forward, 2.5x that backward.
    flops = 4 * batch * hq * seq * seq * d / 2 * 3.5
    return {"shape": f"{batch} x {seq}", "backend": backend.name, "fwd_ms": round(fwd, 3),
            "fwd_bwd_ms": round(total, 3), "tflops": round(flops / total / 1e9, 1)}


def main():
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())
    for batch, seq in [(2, 4096), (1, 8192)]:
        for backend in [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]:
            try:
                print("ANCHOR", json.dumps(run(batch, seq, backend)), flush=True)
            except RuntimeError as error:  # a backend that refuses the shape
                print("ANCHOR", json.dumps({"shape": f"{batch} x {seq}", "backend": backend.name,
                                            "error": str(error).splitlines()[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
