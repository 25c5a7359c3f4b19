// The text model's activation and input layouts (text_activations.h): one carve, counted or real.
#include "model/text/text_activations.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/gated_delta_rule/gated_delta_rule_workspace.h"
#include "kernels/moe_experts/moe_experts_sizes.h"
#include "model/text/text_params.h"

namespace deltamoe {

namespace {

void carve_gdn_saved(ArenaCarver& c, const TextConfig& cfg, const TextActivationSpec& spec, GdnSaved* g) {
  const int64_t T = spec.max_tokens;
  const int64_t kd = cfg.key_dim(), vd = cfg.value_dim(), conv = cfg.conv_dim(), Hv = cfg.linear_num_value_heads;
  g->mixed = c.take<DeviceBf16>(T * conv);
  g->z = c.take<DeviceBf16>(T * vd);
  g->a = c.take<float>(T * Hv);
  g->b = c.take<float>(T * Hv);
  g->q = c.take<DeviceBf16>(T * kd);
  g->k = c.take<DeviceBf16>(T * kd);
  g->v = c.take<DeviceBf16>(T * vd);
  g->q_normed = c.take<DeviceBf16>(T * kd);
  g->k_normed = c.take<DeviceBf16>(T * kd);
  g->g = c.take<float>(T * Hv);
  g->beta = c.take<float>(T * Hv);
  g->core = c.take<DeviceBf16>(T * vd);
  g->normed = c.take<DeviceBf16>(T * vd);
  if (spec.keep_gdn_forward) {
    g->rule_forward_bytes = gated_delta_rule_workspace_layout(T, spec.max_seqs, cfg.linear_num_key_heads, Hv,
                                                              cfg.linear_key_head_dim,
                                                              cfg.linear_value_head_dim, false)
                                .total;
    g->rule_forward = c.take_bytes(g->rule_forward_bytes);
  }
}

void carve_attention_saved(ArenaCarver& c, const TextConfig& cfg, int64_t T, AttentionSaved* a) {
  const int64_t Hq = cfg.num_attention_heads, Hkv = cfg.num_key_value_heads, D = cfg.head_dim;
  a->q_and_gate = c.take<DeviceBf16>(T * Hq * 2 * D);
  a->k_raw = c.take<DeviceBf16>(T * Hkv * D);
  a->v = c.take<DeviceBf16>(T * Hkv * D);
  a->q = c.take<DeviceBf16>(T * Hq * D);
  a->k = c.take<DeviceBf16>(T * Hkv * D);
  a->q_rstd = c.take<float>(T * Hq);
  a->k_rstd = c.take<float>(T * Hkv);
  a->attn = c.take<DeviceBf16>(T * Hq * D);
  a->lse = c.take<float>(T * Hq);
  a->gated = c.take<DeviceBf16>(T * Hq * D);
}

void carve_moe_saved(ArenaCarver& c, const TextConfig& cfg, int64_t T, bool keep_expert_rows, MoeSaved* m) {
  const int64_t E = cfg.num_experts, K = cfg.num_experts_per_tok;
  m->logits = c.take<float>(T * E);
  m->probs = c.take<float>(T * E);
  m->topk_idx = c.take<int32_t>(T * K);
  m->topk_weight = c.take<float>(T * K);
  m->plan_memory = c.take_bytes(moe_routing_plan_bytes(T, E, K));
  if (keep_expert_rows) {
    m->input_rows = c.take<DeviceBf16>(T * K * cfg.hidden_size);
    m->gate_up_rows = c.take<DeviceBf16>(T * K * 2 * cfg.moe_intermediate_size);
  }
}

// A layer's saved state besides its input and its mixer internals: norms, streams, router outputs
// (and the experts' permuted inputs and gate/up rows when kept).
void carve_layer_state(ArenaCarver& c, const TextConfig& cfg, int64_t T, bool keep_expert_rows, LayerActivations* b) {
  const int64_t C = cfg.hidden_size;
  b->normed_in = c.take<DeviceBf16>(T * C);
  b->rstd_in = c.take<float>(T);
  b->mixer_out = c.take<DeviceBf16>(T * C);
  b->h = c.take<float>(T * C);
  b->normed_post = c.take<DeviceBf16>(T * C);
  b->rstd_post = c.take<float>(T);
  b->moe_out = c.take<DeviceBf16>(T * C);
  carve_moe_saved(c, cfg, T, keep_expert_rows, &b->moe);
}

// The one GDN set and the one attention set that layers rerunning their mixer share. Only one
// mixer's internals are live at a time (each is refilled just before its backward), so the two
// sets overlay one block the size of the larger.
struct SharedMixerSets {
  GdnSaved gdn;
  AttentionSaved attn;
};
SharedMixerSets carve_shared_mixer_sets(ArenaCarver& c, const TextConfig& cfg, const TextActivationSpec& spec) {
  const int64_t T = spec.max_tokens;
  SharedMixerSets out;
  ArenaCarver gdn_count(nullptr), attn_count(nullptr);
  carve_gdn_saved(gdn_count, cfg, spec, &out.gdn);
  carve_attention_saved(attn_count, cfg, T, &out.attn);
  const size_t bytes = std::max(gdn_count.used(), attn_count.used());
  void* block = c.take_bytes(bytes);
  ArenaCarver gdn_carver(block, bytes), attn_carver(block, bytes);
  carve_gdn_saved(gdn_carver, cfg, spec, &out.gdn);
  carve_attention_saved(attn_carver, cfg, T, &out.attn);
  return out;
}

}  // namespace

void carve_text_activations(ArenaCarver& c, const TextConfig& cfg, const TextActivationSpec& spec,
                            TextActivations* out) {
  CHECK(spec.max_tokens >= 1, "text activations: the token budget must be positive, got ", spec.max_tokens);
  CHECK(spec.recompute_layers >= 0 && spec.recompute_layers <= cfg.num_hidden_layers,
        "text activations: recompute_layers must be 0..", cfg.num_hidden_layers, ", got ", spec.recompute_layers);
  const int64_t T = spec.max_tokens;
  const int64_t C = cfg.hidden_size, E = cfg.num_experts, K = cfg.num_experts_per_tok;
  const int64_t kd = cfg.key_dim(), vd = cfg.value_dim(), conv = cfg.conv_dim(), Hv = cfg.linear_num_value_heads;
  const int64_t Hq = cfg.num_attention_heads, Hkv = cfg.num_key_value_heads, D = cfg.head_dim;
  // Layers that rerun their mixer (all under share_mixer_state, the recomputed ones otherwise) use
  // the shared mixer sets; fully recomputed layers also share the rest of their saved state (the
  // first one's), keeping only their input.
  const bool any_shared_mixer = spec.share_mixer_state || spec.recompute_layers > 0;
  SharedMixerSets shared;
  if (any_shared_mixer) shared = carve_shared_mixer_sets(c, cfg, spec);
  LayerActivations recomputed_set;
  if (spec.recompute_layers > 0) carve_layer_state(c, cfg, T, false, &recomputed_set);
  out->layers.assign(static_cast<size_t>(cfg.num_hidden_layers), LayerActivations{});
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    LayerActivations& b = out->layers[static_cast<size_t>(i)];
    const bool recomputed = i < spec.recompute_layers;
    if (recomputed) b = recomputed_set;
    b.is_gdn = cfg.layer_types[static_cast<size_t>(i)] == LayerType::linear_attention;
    b.x_in = i == 0 ? nullptr : c.take<float>(T * C);  // layer 0 reads the embedding (set below)
    if (!recomputed) carve_layer_state(c, cfg, T, spec.keep_expert_rows, &b);
    if (spec.share_mixer_state || recomputed) {
      if (b.is_gdn) b.gdn = shared.gdn; else b.attn = shared.attn;
    } else if (b.is_gdn) {
      carve_gdn_saved(c, cfg, spec, &b.gdn);
    } else {
      carve_attention_saved(c, cfg, T, &b.attn);
    }
  }
  // Temporaries of one layer at a time (every backward intermediate).
  const bool any_gdn = cfg.num_layers_of(LayerType::linear_attention) > 0;
  const bool any_attn = cfg.num_layers_of(LayerType::full_attention) > 0;
  LayerScratch& s = out->scratch;
  s = LayerScratch{};
  if (any_gdn) {
    s.d_normed_v = c.take<DeviceBf16>(T * vd);
    s.d_core = c.take<DeviceBf16>(T * vd);
    s.dz = c.take<DeviceBf16>(T * vd);
    s.dq_normed = c.take<DeviceBf16>(T * kd);
    s.dk_normed = c.take<DeviceBf16>(T * kd);
    s.dv = c.take<DeviceBf16>(T * vd);
    s.dg = c.take<float>(T * Hv);
    s.dbeta = c.take<float>(T * Hv);
    s.da = c.take<float>(T * Hv);
    s.db = c.take<float>(T * Hv);
    s.d_conv = c.take<DeviceBf16>(T * 2 * kd);
    s.d_mixed = c.take<DeviceBf16>(T * conv);
  }
  if (any_attn) {
    s.d_gated = c.take<DeviceBf16>(T * Hq * D);
    s.d_q_and_gate = c.take<DeviceBf16>(T * Hq * 2 * D);
    s.dq = c.take<DeviceBf16>(T * Hq * D);
    s.dk = c.take<DeviceBf16>(T * Hkv * D);
    s.dv_attn = c.take<DeviceBf16>(T * Hkv * D);
    s.dk_raw = c.take<DeviceBf16>(T * Hkv * D);
  }
  s.d_topk_weight = c.take<float>(T * K);
  s.d_logits = c.take<float>(T * E);
  s.gate_grad_packed = c.take<DeviceBf16>(T * (any_gdn ? std::max(3 * E, 6 * Hv) : 3 * E));
  s.gate_weight_stack = c.take<DeviceBf16>((any_gdn ? std::max(3 * E, 4 * Hv) : 3 * E) * C);
  if (any_gdn) s.gate_weight_grads = c.take<float>(4 * Hv * C);
  s.router_x_lo = c.take<DeviceBf16>(T * C);
  s.d_mixer_input_f32 = c.take<float>(T * C);

  out->embedded = c.take<float>(T * C);
  if (!out->layers.empty()) out->layers.front().x_in = out->embedded;
  out->final_hidden = c.take<float>(T * C);
  out->final_normed = c.take<DeviceBf16>(T * C);
  out->final_rstd = c.take<float>(T);
  out->grad_stream = c.take<float>(T * C);
  out->grad_stream_bf16 = c.take<DeviceBf16>(T * C);
  out->grad_mixer = c.take<float>(T * C);
  out->grad_mixer_bf16 = c.take<DeviceBf16>(T * C);
  out->grad_normed = c.take<DeviceBf16>(T * C);
  out->image_rows = c.take<int32_t>(spec.max_image_rows);
  out->image_embeds = c.take<DeviceBf16>(spec.max_image_rows * C);
  out->image_grads = c.take<DeviceBf16>(spec.max_image_rows * C);
  out->captured_grads.clear();
  if (spec.capture_layer_grads)
    for (int64_t k = 0; k < 3 * cfg.num_hidden_layers; ++k) out->captured_grads.push_back(c.take<float>(T * C));
}

size_t text_activation_bytes(const TextConfig& config, const TextActivationSpec& spec) {
  ArenaCarver counter(nullptr);
  TextActivations unused;
  carve_text_activations(counter, config, spec, &unused);
  return counter.used();
}

void carve_text_inputs(ArenaCarver& c, const TextConfig& cfg, const TextActivationSpec& spec, TextInputs* out) {
  const int64_t T = spec.max_tokens;
  const int64_t half_rotary = std::max<int64_t>(text_rotary_dim(cfg) / 2, 1);
  out->ids = c.take<int64_t>(T);
  out->labels = c.take<int64_t>(T);
  out->supervised_rows = c.take<int32_t>(T);
  out->embed_sorted_tokens = c.take<int32_t>(T);
  out->embed_segment_offsets = c.take<int32_t>(T + 1);
  out->embed_segment_ids = c.take<int64_t>(T);
  out->cu_seqlens = c.take<int32_t>(spec.max_seqs + 1);
  out->positions = c.take<int64_t>(3 * T);
  out->rope_cos = c.take<float>(T * half_rotary);
  out->rope_sin = c.take<float>(T * half_rotary);
  out->token_loss = c.take<float>(T);
  out->lse = c.take<float>(T);
  out->loss = c.take<float>(1);
  out->aux_loss = c.take<double>(1);
  out->aux_counts = c.take<double>(cfg.num_experts);
  out->aux_probs = c.take<double>(cfg.num_experts);
}

size_t text_input_bytes(const TextConfig& config, const TextActivationSpec& spec) {
  ArenaCarver counter(nullptr);
  TextInputs unused;
  carve_text_inputs(counter, config, spec, &unused);
  return counter.used();
}

}  // namespace deltamoe
