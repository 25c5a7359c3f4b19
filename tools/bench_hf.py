#!/usr/bin/env python3
# Hugging Face transformers' Qwen3.5-MoE text model trained on one GPU at the configuration of
# `deltamoe bench`: full Qwen3.5-35B-A3B widths, N layers typed [lin, lin, lin, full], random
# weights and tokens, grouped_mm experts, the torch Gated DeltaNet fallback, SDPA attention, bf16
# weights and fused AdamW. Prints the same fields as `deltamoe bench` (and a BENCH_JSON line).
# Runs on the GPU machine (needs torch + transformers); see tools/gpu/run_bench.sh.
import argparse
import json
import statistics
import sys

import torch

PEAK_TFLOPS = 989.0      # H200 dense bf16, spec sheet
MEASURED_TFLOPS = 790.0  # cuBLAS bf16 GEMM measured on the H200 (docs/performance.md)
COMPONENTS = ["GDN", "attention", "MoE", "lm_head + loss", "optimizer", "other"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seqs", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--component_steps", type=int, default=3, help="extra steps timed with hooks (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.layers < 1 or a.seqs < 1 or a.steps < 1 or a.warmup < 0:
        p.error("--layers, --seqs and --steps must be >= 1, --warmup >= 0")
    if a.tokens < a.seqs or a.tokens % a.seqs:
        p.error(f"--tokens ({a.tokens}) must be a positive multiple of --seqs ({a.seqs})")
    return a


def text_config(layers):
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    # The class defaults are the 35B-A3B text widths (hidden 2048, 256 experts, top-8, ...).
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    cfg = Qwen3_5MoeTextConfig(num_hidden_layers=layers, layer_types=types)
    cfg._attn_implementation = "sdpa"
    return cfg


def matmul_params_per_token(cfg):
    # Same count as src/train/model_flops.cc: parameters in matmuls per token.
    C = cfg.hidden_size
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    gdn = (2 * key_dim + value_dim) * C + value_dim * C + 2 * cfg.linear_num_value_heads * C + C * value_dim
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attention = 2 * Hq * D * C + 2 * Hkv * D * C + C * Hq * D
    moe = (cfg.num_experts * C + cfg.num_experts_per_tok * 3 * cfg.moe_intermediate_size * C
           + 3 * cfg.shared_expert_intermediate_size * C + C)
    total = cfg.vocab_size * C
    for t in cfg.layer_types:
        total += (gdn if t == "linear_attention" else attention) + moe
    return total


def step_flops(cfg, seqs, seq_len):
    n_attention = sum(1 for t in cfg.layer_types if t == "full_attention")
    attention = n_attention * 6.0 * cfg.num_attention_heads * cfg.head_dim * seq_len * seq_len * seqs
    return 6.0 * matmul_params_per_token(cfg) * seqs * seq_len + attention


def use_torch_gdn(model, M):
    # Force the pure-torch Gated DeltaNet path even where fla / causal-conv1d are installed.
    torch_rule = getattr(M, "torch_chunk_gated_delta_rule", None)
    for m in model.modules():
        if hasattr(m, "chunk_gated_delta_rule") and torch_rule is not None:
            m.chunk_gated_delta_rule = torch_rule
        if hasattr(m, "causal_conv1d_fn"):
            m.causal_conv1d_fn = None


class EventTimer:
    """CUDA events at component boundaries; the time to the next mark counts for the last label."""

    def __init__(self):
        self.marks = []
        self.totals = {c: 0.0 for c in COMPONENTS}

    def mark(self, label):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.marks.append((label, e))

    def finish(self):
        self.mark("other")
        torch.cuda.synchronize()
        for (label, a), (_, b) in zip(self.marks, self.marks[1:]):
            self.totals[label] += a.elapsed_time(b)
        self.marks = []


def attach_hooks(model, timer):
    handles = []

    def around(module, label):
        handles.append(module.register_forward_pre_hook(lambda *_: timer.mark(label)))
        handles.append(module.register_forward_hook(lambda *_: timer.mark("other")))
        handles.append(module.register_full_backward_pre_hook(lambda *_: timer.mark(label)))
        handles.append(module.register_full_backward_hook(lambda *_: timer.mark("other")))

    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            around(layer.linear_attn, "GDN")
        if hasattr(layer, "self_attn"):
            around(layer.self_attn, "attention")
        around(layer.mlp, "MoE")
    # lm_head forward through the loss is one interval (no closing forward hook); its backward
    # interval is opened before loss.backward() by the step and closed by the backward hook.
    handles.append(model.lm_head.register_forward_pre_hook(lambda *_: timer.mark("lm_head + loss")))
    handles.append(model.lm_head.register_full_backward_hook(lambda *_: timer.mark("other")))
    return handles


def main():
    args = parse_args()
    import transformers
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as M

    dev = "cuda"
    torch.manual_seed(args.seed)
    cfg = text_config(args.layers)
    with torch.device(dev):
        model = M.Qwen3_5MoeForCausalLM(cfg).to(torch.bfloat16)
    try:
        model.set_experts_implementation("grouped_mm")
    except Exception:
        model.config._experts_implementation = "grouped_mm"
    use_torch_gdn(model, M)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    seq_len = args.tokens // args.seqs
    ids = torch.randint(0, cfg.vocab_size, (args.seqs, seq_len), device=dev)
    timer = None

    def step():
        out = model(input_ids=ids, labels=ids)
        if timer is not None:
            timer.mark("lm_head + loss")
        out.loss.backward()
        if timer is not None:
            timer.mark("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if timer is not None:
            timer.mark("other")
        return out.loss.detach()

    losses, times = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        stop.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(stop)
        losses.append(float(loss))
        print(f"step {i + 1:3d} {'warm' if i < args.warmup else '    '} {ms:8.2f} ms  loss {losses[-1]:.4f}", flush=True)
        if i >= args.warmup:
            times.append(ms)
    peak = torch.cuda.max_memory_allocated()

    components = {}
    if args.component_steps > 0:
        timer = EventTimer()
        handles = attach_hooks(model, timer)
        try:
            for _ in range(args.component_steps):
                timer.mark("other")
                step()
                timer.finish()
            components = {c: v / args.component_steps for c, v in timer.totals.items()}
        except Exception as e:  # hooks can fail on in-place ops; the step numbers stand without them
            print("component timing failed:", repr(e)[:300], flush=True)
        for h in handles:
            h.remove()

    gib = 2.0 ** 30
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = weights  # bf16 gradients of the same shapes (freed at zero_grad, present at the peak)
    optim = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    step_ms = statistics.median(times)
    tokens_per_s = args.tokens / (step_ms / 1e3)
    flops = step_flops(cfg, args.seqs, seq_len)
    tflops = flops / (step_ms / 1e3) / 1e12
    gpu = torch.cuda.get_device_name(0)
    n_gdn = sum(1 for t in cfg.layer_types if t == "linear_attention")
    print(f"\n== transformers {transformers.__version__} (torch {torch.__version__}) bench: {gpu}, {args.layers} layers "
          f"({n_gdn} GDN + {args.layers - n_gdn} attention), {args.tokens} tokens as {args.seqs} x {seq_len} ==")
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B total, "
          f"{matmul_params_per_token(cfg) / 1e9:.3f} B in matmuls per token; AdamW state {next(iter(opt.state.values()))['exp_avg'].dtype}")
    print(f"step time: median {step_ms:.2f} ms over {args.steps} steps (min {min(times):.2f}, max {max(times):.2f})")
    print(f"tokens/s: {tokens_per_s:.0f}")
    print(f"model TFLOP/s: {tflops:.1f} ({flops / args.tokens / 1e9:.2f} GFLOP per token)")
    print(f"MFU: {100 * tflops / PEAK_TFLOPS:.1f}% of {PEAK_TFLOPS:.0f} TFLOP/s peak, "
          f"{100 * tflops / MEASURED_TFLOPS:.1f}% of {MEASURED_TFLOPS:.0f} measured GEMM")
    print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")
    print(f"memory: peak allocated {peak / gib:.2f} GiB")
    print(f"  weights (bf16)               {weights / gib:.2f} GiB")
    print(f"  gradients (bf16)             {grads / gib:.2f} GiB")
    print(f"  optimizer state              {optim / gib:.2f} GiB")
    print(f"  activations + workspace      {max(peak - weights - grads - optim, 0) / gib:.2f} GiB (rest of the peak)")
    if components:
        total = sum(components.values())
        print(f"time per step by component (CUDA events from module hooks, mean of {args.component_steps} extra steps):")
        for c in COMPONENTS:
            print(f"  {c:16s} {components[c]:9.2f} ms  {100 * components[c] / total if total else 0:5.1f}%")
    result = {"engine": "transformers", "gpu": gpu, "layers": args.layers, "tokens": args.tokens, "seqs": args.seqs,
              "step_ms": step_ms, "tokens_per_s": tokens_per_s, "tflops": tflops,
              "mfu_peak": tflops / PEAK_TFLOPS, "mfu_measured": tflops / MEASURED_TFLOPS,
              "peak_mem_gib": peak / gib, "loss_first": losses[0], "loss_last": losses[-1],
              "components_ms": components}
    print("BENCH_JSON " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
