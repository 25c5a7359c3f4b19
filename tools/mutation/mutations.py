"""The planted bugs that run_mutations.py checks the test suite against.

Each mutation is one small edit a careless change could make, and the tests that must catch it:
  name     short id (also the name of its patch file in --gpu mode)
  why      what the edit breaks, in words
  file     path from the repository root
  find     exact text that must occur exactly once, replaced by `replace`; or
  regex    a Python regular expression, every match replaced by `replace` (\\1 etc. allowed);
           at least one match is required, else the mutation is reported as not applicable
  tests    test programs (ctest names) that should fail with the edit; caught = at least one does
  device   "cpu" (run here) or "gpu" (built here into gpu_mutants/ by --gpu; run on the GPU machine
           by tools/gpu/mutation_check.sh)
"""

MUTATIONS = [
    dict(
        name="lora_dropout_da_undropped",
        why="LoRA dropout: the adapter's dA formed from x instead of the dropped x'",
        file="src/model/text/projection.cc",
        find="  linear_backward_ref(x_lora, ad.a, d_xa.data(), dx != nullptr ? dx_part.data() : nullptr, d_a, rows, in_features,",
        replace="  linear_backward_ref(x, ad.a, d_xa.data(), dx != nullptr ? dx_part.data() : nullptr, d_a, rows, in_features,",
        tests=["lora_test"],
        device="cpu",
    ),
    dict(
        name="lora_dropout_dx_unmasked",
        why="LoRA dropout: the adapter's input gradient not sent back through the mask",
        file="src/model/text/projection.cc",
        find="    if (ad.dropout.active()) lora_dropout_apply_ref(ad.dropout, dx_part.data(), dx_part.data(), rows, in_features);",
        replace="",
        tests=["lora_test"],
        device="cpu",
    ),
    dict(
        name="lora_dropout_one_lane",
        why="LoRA dropout mask: the four columns of a Philox block share one word",
        file="src/kernels/lora/lora_dropout_mask.h",
        find="  return block.v[col & 3] >= m.threshold ? m.keep_scale : 0.0f;",
        replace="  return block.v[0] >= m.threshold ? m.keep_scale : 0.0f;",
        tests=["lora_dropout_mask_test"],
        device="cpu",
    ),
    dict(
        name="bicubic_a_minus_0.75",
        why="bicubic kernel parameter -0.75 (OpenCV's) instead of PIL's -0.5",
        file="src/data/image_resize.cc",
        find="constexpr double kBicubicA = -0.5;",
        replace="constexpr double kBicubicA = -0.75;",
        tests=["image_resize_test", "image_preprocess_golden_test"],
        device="cpu",
    ),
    dict(
        name="warmup_ratio_cases_all_null",
        why="every warmup_ratio case of the torch golden without transformers' answer (null)",
        file="src/optim/testdata/torch_adamw.json",
        regex=r'("warmup_ratio": [0-9.eE+-]+, "warmup_steps": )-?[0-9]+',
        replace=r"\1null",
        tests=["adamw_golden_test"],
        device="cpu",
    ),
    dict(
        name="rope_theta_1e-3",
        why="rope_theta off by 0.1%",
        file="src/model/text/text_batch.cc",
        find="batch.rope.theta = config.rope_theta;",
        replace="batch.rope.theta = config.rope_theta * 1.001;",
        tests=["parity_golden_test"],
        device="cpu",
    ),
    dict(
        name="resume_position_dropped",
        why="a resumed run starts the data from the beginning instead of its saved position",
        file="src/train/trainer.cc",
        find="DataPipeline pipeline(packing, tokenizer, state.data_position);",
        replace="DataPipeline pipeline(packing, tokenizer, DataPosition{});",
        tests=["trainer_resume_test"],
        device="cpu",
    ),
    dict(
        name="bpe_queue_tie_break_rightmost",
        why="among equal-rank pairs the priority queue merges the rightmost first",
        file="src/tokenizer/bpe.cc",
        find="return rank != other.rank ? rank > other.rank : position > other.position;",
        replace="return rank != other.rank ? rank > other.rank : position < other.position;",
        tests=["tokenizer_test", "tokenizer_parity_test"],
        device="cpu",
    ),
    dict(
        name="bpe_scan_tie_break_rightmost",
        why="among equal-rank pairs the direct scan (short pieces) merges the rightmost first",
        file="src/tokenizer/bpe.cc",
        find="(best == pairs.size() || pairs[i].rank < pairs[best].rank)",
        replace="(best == pairs.size() || pairs[i].rank <= pairs[best].rank)",
        tests=["tokenizer_test", "tokenizer_parity_test"],
        device="cpu",
    ),
    dict(
        name="weight_decay_1e-3",
        why="AdamW weight decay off by 0.1%",
        file="src/optim/adamw.cc",
        find="scalars.decay_factor = static_cast<float>(1.0 - lr * config.weight_decay);",
        replace="scalars.decay_factor = static_cast<float>(1.0 - lr * config.weight_decay * 1.001);",
        tests=["adamw_golden_test", "adamw_test"],
        device="cpu",
    ),
    dict(
        name="empty_think_block_supervised",
        why="the empty <think>\\n\\n</think>\\n\\n block of an assistant turn gets labels",
        file="src/tokenizer/chat_template.cc",
        find="return role == SpanRole::kThink || role == SpanRole::kAssistant",
        replace="return role == SpanRole::kThink || role == SpanRole::kEmptyThink || role == SpanRole::kAssistant",
        tests=["sample_builder_test", "chat_template_test"],
        device="cpu",
    ),
    # GPU engine bugs (issue 23's acceptance), planted in the GPU text model's backward itself so that
    # every GPU test that trains through it sees them: gpu_text_model_gpu_test (each layer alone and
    # the whole model, tiny and text_8layer's architecture), gpu_parity_golden_gpu_test (the cases fit
    # for a bound), gpu_engine_gpu_test (the engine on tiny-vl). Built by --gpu into gpu_mutants/,
    # run on the GPU machine by tools/gpu/mutation_check.sh.
    dict(
        name="gpu_gdn_out_proj_grad_sign_flipped",
        why="every GDN layer's out_proj weight gradient accumulated with alpha -1 (sign flipped)",
        file="src/model/text/gpu/gpu_gdn_layer.cc",
        find="  weight_grad(W.out_proj, dy, s.normed, T, vd, C);",
        replace=(
            "  if (W.out_proj.grad != nullptr)\n"
            "    gemm_bf16_cuda(*gemm_, true, false, C, vd, T, -1.0f, dy, C, s.normed, vd, 1.0f, W.out_proj.grad,\n"
            "                   DType::f32, vd, stream_);"
        ),
        tests=["gpu_text_model_gpu_test", "gpu_parity_golden_gpu_test", "gpu_engine_gpu_test"],
        device="gpu",
    ),
    dict(
        name="gpu_attention_o_proj_grad_sign_flipped",
        why="every full-attention layer's o_proj weight gradient accumulated with alpha -1 (sign flipped)",
        file="src/model/text/gpu/gpu_attention_layer.cc",
        find="  weight_grad(W.o_proj, dy, s.gated, T, Hq * D, C);",
        replace=(
            "  if (W.o_proj.grad != nullptr)\n"
            "    gemm_bf16_cuda(*gemm_, true, false, C, Hq * D, T, -1.0f, dy, C, s.gated, Hq * D, 1.0f, W.o_proj.grad,\n"
            "                   DType::f32, Hq * D, stream_);"
        ),
        tests=["gpu_text_model_gpu_test", "gpu_parity_golden_gpu_test", "gpu_engine_gpu_test"],
        device="gpu",
    ),
    dict(
        name="gpu_conv_backward_crosses_sequences",
        why="the causal conv1d backward adds the next sequence's first tokens into the last tokens' dx",
        file="src/kernels/causal_conv1d/causal_conv1d.cu",
        find="          if (seq_win[K - 1 - j] == seq_win[K - 1]) {",
        replace="          if (seq_win[K - 1 - j] >= 0) {",
        tests=["causal_conv1d_gpu_test", "gpu_text_model_gpu_test"],
        device="gpu",
    ),
    dict(
        name="gpu_expert_weight_grads_zero",
        why="the routed experts' weight-gradient products skipped (as if frozen): all-zero expert gradients",
        file="src/model/text/gpu/gpu_moe_block.cc",
        find="W.experts_gate_up.grad_data(), W.experts_down.grad_data(), expert_grads_dtype(W),",
        replace="nullptr, nullptr, expert_grads_dtype(W),",
        tests=["gpu_text_model_gpu_test", "gpu_parity_golden_gpu_test", "gpu_engine_gpu_test"],
        device="gpu",
    ),
    dict(
        name="ep_owner_rows_reversed",
        why="an expert's owner adds the received rows' weight gradients in reverse order",
        file="src/model/text/moe_block.cc",
        find="  for (int64_t r = 0; r < R; ++r) {\n    const float* in = recv.data() + r * W;",
        replace="  for (int64_t r = R - 1; r >= 0; --r) {\n    const float* in = recv.data() + r * W;",
        tests=["cpu_engine_parallel_test"],
        device="cpu",
    ),
    dict(
        name="zero2_dense_gradient_kept_across_micro_batches",
        why="ZeRO-2 reduces running dense totals instead of each micro-batch's own gradient",
        file="src/train/cpu_engine.cc",
        find="      std::fill(micro_grad_.begin() + entry.offset, micro_grad_.begin() + entry.offset + entry.numel, 0.0f);",
        replace="      if (g == 0) std::fill(micro_grad_.begin() + entry.offset, micro_grad_.begin() + entry.offset + entry.numel, 0.0f);",
        tests=["cpu_engine_parallel_test"],
        device="cpu",
    ),
    dict(
        name="rank_reads_every_micro_batch",
        why="every rank keeps (and decodes) every micro-batch of the global batch, not its own share",
        file="src/train/step_batch_reader.cc",
        find="if (step.num_read % share_.world == share_.rank) step.batches.push_back(std::move(*batch));",
        replace="step.batches.push_back(std::move(*batch));",
        tests=["step_batch_reader_test"],
        device="cpu",
    ),
    dict(
        name="model_range_written_at_tensor_start",
        why="a rank's byte range of a tensor is written at the tensor's first byte instead of its own offset",
        file="src/checkpoint/model_dir_writer.cc",
        find="layout.file_offset[range.tensor] + range.begin,",
        replace="layout.file_offset[range.tensor],",
        tests=["rank_checkpoint_test"],
        device="cpu",
    ),
    dict(
        name="replicas_write_their_experts",
        why="every replica of an expert block writes it into the model files (bytes written twice)",
        file="src/train/rank_checkpoint.cc",
        find="if (parallel != nullptr && !parallel->first_expert_replica()) {",
        replace="if (false) {",
        tests=["rank_checkpoint_test"],
        device="cpu",
    ),
]

from mutations_hardening import HARDENING_MUTATIONS  # noqa: E402  (issue 22's fixes undone)

MUTATIONS += HARDENING_MUTATIONS
