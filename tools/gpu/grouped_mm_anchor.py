#!/usr/bin/env python3
"""The anchor for the grouped expert GEMM: torch._grouped_mm on the shapes of grouped_gemm_gpu_test's
Timing35B (8,192 tokens x top-8 = 65,536 rows over E = 256 experts, H = 2048, I = 512), bf16, timed
with CUDA events (median of 20 after 5 warm-ups). Routing as in the test: each row to a uniformly
random expert; also the balanced case (256 rows per expert). Prints one TIMING line per product:
the row products (3D weights, offs over the rows) and the weight gradients (2D x 2D, offs over K:
dW_e = dY_e^T X_e as grouped_gemm_weight_grad_cuda, written; in bf16, and in f32 where this torch
takes out_dtype), with the floor beside each dW (FLOPs at 790 TFLOP/s, output bytes at 4 TB/s)."""
import torch

from cuda_event_timing import median_ms

E, H, I, ROWS = 256, 2048, 512, 8192 * 8


def main():
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(ROWS, H, device=dev, dtype=torch.bfloat16)
    h = torch.randn(ROWS, 2 * I, device=dev, dtype=torch.bfloat16)
    h_i = torch.randn(ROWS, I, device=dev, dtype=torch.bfloat16)
    w_gu = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02  # [E, N, K] as the engine stores it
    w_down = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02
    counts = {
        "random": torch.bincount(torch.randint(0, E, (ROWS,), device=dev), minlength=E),
        "balanced": torch.full((E,), ROWS // E, device=dev, dtype=torch.int64),
    }
    for routing, count in counts.items():
        offs = torch.cumsum(count, 0).to(torch.int32)
        products = [
            ("gate_up fwd  [R,H]x[E,2I,H]^T", x, w_gu.transpose(-2, -1), 2.0 * ROWS * 2 * I * H),
            ("down fwd     [R,I]x[E,H,I]^T", h_i, w_down.transpose(-2, -1), 2.0 * ROWS * H * I),
            ("gate_up dX   [R,2I]x[E,2I,H]", h, w_gu, 2.0 * ROWS * 2 * I * H),
            ("down dX      [R,H]x[E,H,I]", x, w_down, 2.0 * ROWS * H * I),
        ]
        for name, a, b, flops in products:
            ms = median_ms(lambda: torch._grouped_mm(a, b, offs=offs))
            print(f"  TIMING torch._grouped_mm {routing:8s} {name:32s} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s")
        # Weight gradients: the K of each product is the expert's rows; dY^T as a transposed view.
        weight_grads = [
            ("gate_up dW   [R,2I]^T[R,H]", h, x, 2 * I, H),
            ("down dW      [R,H]^T[R,I]", x, h_i, H, I),
        ]
        for name, dy, xin, m, n in weight_grads:
            flops = 2.0 * ROWS * m * n
            for out_dtype in (None, torch.float32):
                label = name + (" f32=" if out_dtype is not None else " bf16=")
                try:
                    fn = (lambda: torch._grouped_mm(dy.t(), xin, offs=offs)) if out_dtype is None else (
                        lambda: torch._grouped_mm(dy.t(), xin, offs=offs, out_dtype=out_dtype))
                    ms = median_ms(fn)
                except (RuntimeError, TypeError) as error:
                    print(f"  torch._grouped_mm {routing:8s} {label:32s} not available: {str(error).splitlines()[0]}")
                    continue
                out_bytes = E * m * n * (4 if out_dtype is not None else 2)
                floor = max(flops / 790e12, out_bytes / 4e12) * 1e3
                print(f"  TIMING torch._grouped_mm {routing:8s} {label:32s} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} "
                      f"TFLOP/s  (floor {floor:.3f} ms)")


if __name__ == "__main__":
    main()
