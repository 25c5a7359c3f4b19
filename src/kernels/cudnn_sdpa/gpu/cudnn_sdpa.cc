// cuDNN fused SDPA through the backend graph API (cudnn_sdpa.h). We describe the attention as the
// composite graph of matmul / pointwise / reduction / reshape nodes that cuDNN's runtime-fusion
// engine recognises and lowers to its flash-attention kernels; the node sequence, data types and
// layouts follow what cudnn-frontend's CompositeSDPANode / CompositeSDPABackwardNode emit for
// cuDNN 9.19 (padding mask for the ragged layout, top-left causal mask, fp32 intermediates, bf16
// P and dS before their products). Layout "THD": every tensor is [N, H, S, D] with S = the plan's
// maximum tokens, rows H * D apart, and a ragged-offset tensor giving each sequence's first
// element; per-sequence lengths bound the GEMMs (M/N/K overrides) and the padding mask.
#include "kernels/cudnn_sdpa/gpu/cudnn_sdpa.h"

#include <cudnn.h>

#include <array>
#include <atomic>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <map>
#include <string_view>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/error.h"
#include "core/log.h"
#include "kernels/common/kernel_path_cuda.h"
#include "kernels/cudnn_sdpa/gpu/cudnn_check.h"

// The operation-graph and plan HANDLE attributes are marked deprecated in cuDNN 9 headers but are
// still what the library reads (cudnn-frontend sets them too).
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace deltamoe {
namespace {

std::atomic<int64_t> g_plans_built{0};

constexpr size_t kAlign = 256;
size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

using Dims = std::array<int64_t, 4>;

// One backend descriptor, destroyed with its owner. Error contexts are string views so that the
// per-call descriptors (the variant pack) cost no host allocation.
class Desc {
 public:
  Desc() = default;
  Desc(cudnnBackendDescriptorType_t type, std::string_view where) {
    CUDNN_CHECK_AT(where, cudnnBackendCreateDescriptor(type, &desc_));
  }
  ~Desc() {
    if (desc_ != nullptr) cudnnBackendDestroyDescriptor(desc_);
  }
  Desc(Desc&& other) noexcept : desc_(std::exchange(other.desc_, nullptr)) {}
  Desc& operator=(Desc&& other) noexcept {
    if (this != &other) {
      if (desc_ != nullptr) cudnnBackendDestroyDescriptor(desc_);
      desc_ = std::exchange(other.desc_, nullptr);
    }
    return *this;
  }
  cudnnBackendDescriptor_t get() const { return desc_; }

 private:
  cudnnBackendDescriptor_t desc_ = nullptr;
};

void set_attr(const Desc& desc, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
              const void* values, std::string_view where) {
  CUDNN_CHECK_AT(str_cat(where, " (attribute ", static_cast<int>(name), ")"),
                 cudnnBackendSetAttribute(desc.get(), name, type, count, values));
}

void set_desc(const Desc& desc, cudnnBackendAttributeName_t name, const Desc& value, std::string_view where) {
  cudnnBackendDescriptor_t raw = value.get();
  set_attr(desc, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw, where);
}

void finalize(const Desc& desc, std::string_view where) {
  CUDNN_CHECK_AT(str_cat(where, " (finalize)"), cudnnBackendFinalize(desc.get()));
}

// An operation graph under construction: tensors by unique id, operations in order, and the host
// values of by-value scalars (their variant-pack pointers). Every error names the graph and node.
class Graph {
 public:
  explicit Graph(std::string name) : name_(std::move(name)) {}

  int64_t tensor(const std::string& label, cudnnDataType_t type, const Dims& dims, const Dims& strides,
                 bool is_virtual, int64_t ragged_offset_uid = -1) {
    return make_tensor(label, type, dims, strides, is_virtual, false, ragged_offset_uid);
  }
  int64_t virt(const std::string& label, cudnnDataType_t type, const Dims& dims, const Dims& strides,
               int64_t ragged_offset_uid = -1) {
    return make_tensor(label, type, dims, strides, true, false, ragged_offset_uid);
  }
  // A [1,1,1,1] fp32 scalar passed by value; *value must outlive every execution.
  int64_t scalar(const std::string& label, const float* value) {
    const int64_t uid = make_tensor(label, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true, -1);
    by_value_.emplace_back(uid, value);
    return uid;
  }

  void pointwise(const std::string& label, cudnnPointwiseMode_t mode, cudnnDataType_t compute, int64_t x, int64_t b,
                 int64_t t, int64_t y, int64_t axis = -1) {
    const std::string where = node_where(label);
    Desc pw(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, where);
    set_attr(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, where);
    set_attr(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &compute, where);
    if (mode == CUDNN_POINTWISE_GEN_INDEX) set_attr(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, where);
    finalize(pw, where);
    Desc op(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, where);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw, where);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, at(x), where);
    if (b >= 0) set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, at(b), where);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, at(y), where);
    if (t >= 0) set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, at(t), where);
    finalize(op, where);
    keep_.push_back(std::move(pw));
    ops_.push_back(std::move(op));
  }

  // C = A B with fp32 accumulation; the overrides are [N,1,1,1] int32 per-batch GEMM sizes.
  void matmul(const std::string& label, int64_t a, int64_t b, int64_t c, int64_t m_override, int64_t n_override,
              int64_t k_override) {
    const std::string where = node_where(label);
    Desc mm(CUDNN_BACKEND_MATMUL_DESCRIPTOR, where);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    set_attr(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, where);
    finalize(mm, where);
    Desc op(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, where);
    set_desc(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, at(a), where);
    set_desc(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, at(b), where);
    set_desc(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, at(c), where);
    set_desc(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, mm, where);
    if (m_override >= 0) set_desc(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, at(m_override), where);
    if (n_override >= 0) set_desc(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, at(n_override), where);
    if (k_override >= 0) set_desc(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, at(k_override), where);
    finalize(op, where);
    keep_.push_back(std::move(mm));
    ops_.push_back(std::move(op));
  }

  void reduction(const std::string& label, cudnnReduceTensorOp_t mode, int64_t x, int64_t y) {
    const std::string where = node_where(label);
    Desc red(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, where);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    set_attr(red, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, where);
    set_attr(red, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, where);
    finalize(red, where);
    Desc op(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, where);
    set_desc(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, at(x), where);
    set_desc(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, at(y), where);
    set_desc(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, red, where);
    finalize(op, where);
    keep_.push_back(std::move(red));
    ops_.push_back(std::move(op));
  }

  // A view of x with other dims/strides (a transpose for the GEMMs' operands).
  void reshape(const std::string& label, int64_t x, int64_t y) {
    const std::string where = node_where(label);
    Desc op(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, where);
    set_desc(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, at(x), where);
    set_desc(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, at(y), where);
    finalize(op, where);
    ops_.push_back(std::move(op));
  }

  // Operation graph -> engine heuristics (mode A, then the fallback list) -> the first engine
  // configuration whose plan finalizes. Throws naming the graph when none does.
  Desc build_plan(cudnnHandle_t handle, int64_t* workspace_bytes) {
    const std::string where = name_ + " graph";
    std::vector<cudnnBackendDescriptor_t> raw_ops;
    for (const Desc& op : ops_) raw_ops.push_back(op.get());
    op_graph_ = Desc(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, where);
    set_attr(op_graph_, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
             static_cast<int64_t>(raw_ops.size()), raw_ops.data(), where + ", operation graph");
    set_attr(op_graph_, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, where + ", operation graph");
    finalize(op_graph_, where + ", operation graph of " + std::to_string(raw_ops.size()) + " nodes");

    std::string failures;
    int tried = 0;
    for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      const std::string heur_where = where + ", heuristics mode " + std::to_string(static_cast<int>(mode));
      Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, heur_where);
      set_desc(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, op_graph_, heur_where);
      set_attr(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, heur_where);
      if (cudnnBackendFinalize(heur.get()) != CUDNN_STATUS_SUCCESS) {
        failures += " [" + heur_where + ": " + cudnn_last_error() + "]";
        continue;
      }
      int64_t count = 0;
      CUDNN_CHECK_AT(heur_where, cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                          CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr));
      if (count <= 0) {
        failures += " [" + heur_where + ": no engine configurations]";
        continue;
      }
      std::vector<Desc> configs;
      std::vector<cudnnBackendDescriptor_t> raw_configs;
      for (int64_t i = 0; i < count; ++i) {
        configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, heur_where);
        raw_configs.push_back(configs.back().get());
      }
      int64_t got = 0;
      CUDNN_CHECK_AT(heur_where, cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                          CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got,
                                                          raw_configs.data()));
      for (int64_t i = 0; i < got; ++i) {
        ++tried;
        const std::string plan_where = heur_where + ", engine config " + std::to_string(i);
        Desc plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, plan_where);
        set_attr(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, plan_where);
        set_desc(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, configs[i], plan_where);
        if (cudnnBackendFinalize(plan.get()) != CUDNN_STATUS_SUCCESS) {
          failures += " [" + plan_where + ": " + cudnn_last_error() + "]";
          continue;
        }
        int64_t bytes = 0, elements = 0;
        CUDNN_CHECK_AT(plan_where, cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                            CUDNN_TYPE_INT64, 1, &elements, &bytes));
        *workspace_bytes = bytes;
        ++g_plans_built;
        return plan;
      }
    }
    RAISE(where, ": no cuDNN engine accepted the graph (", tried, " configurations tried):", failures);
  }

  // The variant pack's (uid, pointer) pairs for the by-value scalars.
  const std::vector<std::pair<int64_t, const float*>>& by_value() const { return by_value_; }

 private:
  int64_t make_tensor(const std::string& label, cudnnDataType_t type, const Dims& dims, const Dims& strides,
                      bool is_virtual, bool by_value, int64_t ragged_offset_uid) {
    const int64_t uid = next_uid_++;
    const std::string where = name_ + " graph, tensor '" + label + "'";
    Desc desc(CUDNN_BACKEND_TENSOR_DESCRIPTOR, where);
    set_attr(desc, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, where);
    set_attr(desc, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data(), where);
    set_attr(desc, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data(), where);
    set_attr(desc, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, where);
    const int64_t alignment = 16;
    set_attr(desc, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, where);
    const bool virtual_flag = is_virtual;
    set_attr(desc, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virtual_flag, where);
    if (by_value) {
      const bool by_value_flag = true;
      set_attr(desc, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value_flag, where);
    }
    if (ragged_offset_uid >= 0) set_desc(desc, CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, at(ragged_offset_uid), where);
    finalize(desc, where);
    tensors_.emplace(uid, std::move(desc));
    return uid;
  }
  const Desc& at(int64_t uid) const { return tensors_.at(uid); }
  std::string node_where(const std::string& label) const { return name_ + " graph, node '" + label + "'"; }

  std::string name_;
  int64_t next_uid_ = 1;
  std::map<int64_t, Desc> tensors_;
  std::vector<Desc> ops_;
  std::vector<Desc> keep_;  // pointwise/matmul/reduction descriptors the operations point to
  Desc op_graph_;
  std::vector<std::pair<int64_t, const float*>> by_value_;
};

// One execution's (uid, device pointer) pairs, in fixed storage: a step allocates nothing on the host
// for them. The batch arrays and by-value scalars both graphs take are added by common_pack.
class VariantPack {
 public:
  void add(int64_t uid, const void* pointer) {
    CHECK(size_ < kCapacity, "cuDNN SDPA: a variant pack holds at most ", kCapacity, " tensors");
    uids_[size_] = uid;
    pointers_[size_] = const_cast<void*>(pointer);
    ++size_;
  }
  void execute(cudnnHandle_t handle, const Desc& plan, void* workspace, const char* where) const {
    Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, where);
    set_attr(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, size_, uids_.data(), where);
    set_attr(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, size_, pointers_.data(), where);
    set_attr(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace, where);
    finalize(pack, where);
    CUDNN_CHECK_AT(where, cudnnBackendExecute(handle, plan.get(), pack.get()));
  }

 private:
  static constexpr int64_t kCapacity = 32;  // the backward with grouped heads takes 20 plus its scalars
  std::array<int64_t, kCapacity> uids_{};
  std::array<void*, kCapacity> pointers_{};
  int64_t size_ = 0;
};

}  // namespace

// The batch arrays (uids per graph) and the plans. Address-stable (held by unique_ptr): the
// by-value scalars' pointers point into it.
struct CudnnSdpa::Impl {
  cudnnHandle_t handle = nullptr;
  float scale = 0;
  float negative_infinity = -std::numeric_limits<float>::infinity();
  float one = 1.0f;

  // Tensor uids of one graph.
  struct Uids {
    int64_t seq_len_q = -1, seq_len_kv = -1, offsets_q = -1, offsets_k = -1, offsets_o = -1, offsets_v = -1,
            offsets_stats = -1;
    int64_t q = -1, k = -1, v = -1, o = -1, stats = -1, d_o = -1, dq = -1, dk = -1, dv = -1;
    int64_t softmax_sum = -1, dq_accum = -1, dk_full = -1, dv_full = -1;
  };
  Graph forward_graph{"cuDNN SDPA forward"};
  Graph backward_graph{"cuDNN SDPA backward"};
  Uids fwd, bwd;
  Desc forward_plan, backward_plan;
  int64_t forward_plan_workspace = 0, backward_plan_workspace = 0;

  // Workspace layout: batch arrays | (backward: softmax_sum fp32 [T, Hq] | dQ accumulator fp32
  // [T, Hq, D] | with grouped heads, the per-query-head dK and dV) | the plan's own workspace.
  size_t batch_array_bytes = 0, softmax_sum_bytes = 0, dq_accum_bytes = 0, full_heads_bytes = 0;

  ~Impl() {
    if (handle != nullptr) cudnnDestroy(handle);
  }
};

namespace {

// S: the rows of one batch entry (the packed tensors' element offsets come from the ragged offsets,
// so S bounds each sequence's length, not the tokens of a call).
int64_t sequence_rows(const CudnnSdpaConfig& c) {
  return c.max_sequence_tokens > 0 ? c.max_sequence_tokens : c.max_tokens;
}

// The attention-score tensors [N, Hq, S, S] and row statistics [N, Hq, S, 1] (virtual, fp32).
struct ScoreShapes {
  Dims scores, scores_strides, transposed_strides, rows, rows_strides;
};

ScoreShapes score_shapes(const CudnnSdpaConfig& c) {
  const int64_t N = c.max_segments, H = c.num_q_heads, S = sequence_rows(c);
  return {{N, H, S, S}, {H * S * S, S * S, S, 1}, {H * S * S, S * S, 1, S}, {N, H, S, 1}, {H * S, S, 1, 1}};
}

// Batch arrays shared by both graphs: lengths [N,1,1,1] and ragged element offsets [N+1,1,1,1] of
// the Q-like rows (Q, dQ: Hq * D), K-like (K, dK: Hkv * D), O-like (O, dO: Hq * Dv), V-like (V, dV:
// Hkv * Dv) and the statistics (Hq).
void add_batch_arrays(Graph& g, const CudnnSdpaConfig& c, CudnnSdpa::Impl::Uids& u) {
  const int64_t N = c.max_segments;
  u.seq_len_q = g.tensor("seq_len_q", CUDNN_DATA_INT32, {N, 1, 1, 1}, {1, 1, 1, 1}, false);
  u.seq_len_kv = g.tensor("seq_len_kv", CUDNN_DATA_INT32, {N, 1, 1, 1}, {1, 1, 1, 1}, false);
  u.offsets_q = g.tensor("ragged_offsets_q", CUDNN_DATA_INT32, {N + 1, 1, 1, 1}, {1, 1, 1, 1}, false);
  u.offsets_k = g.tensor("ragged_offsets_k", CUDNN_DATA_INT32, {N + 1, 1, 1, 1}, {1, 1, 1, 1}, false);
  u.offsets_o = g.tensor("ragged_offsets_o", CUDNN_DATA_INT32, {N + 1, 1, 1, 1}, {1, 1, 1, 1}, false);
  u.offsets_v = g.tensor("ragged_offsets_v", CUDNN_DATA_INT32, {N + 1, 1, 1, 1}, {1, 1, 1, 1}, false);
  u.offsets_stats = g.tensor("ragged_offsets_stats", CUDNN_DATA_INT32, {N + 1, 1, 1, 1}, {1, 1, 1, 1}, false);
}

int64_t value_dim(const CudnnSdpaConfig& c) { return c.value_dim > 0 ? c.value_dim : c.head_dim; }

// Q-like [N, H, S, dim] rows H * dim apart (Q, O, dQ, dO with H = Hq; K, V, dK, dV with H = Hkv);
// K^T / V^T [N, H, dim, S] as the GEMMs read them.
Dims rows_dims(const CudnnSdpaConfig& c, int64_t heads, int64_t dim) {
  return {c.max_segments, heads, sequence_rows(c), dim};
}
Dims rows_strides(const CudnnSdpaConfig& c, int64_t heads, int64_t dim) {
  const int64_t S = sequence_rows(c);
  return {S * heads * dim, dim, heads * dim, 1};
}
Dims transposed_dims(const CudnnSdpaConfig& c, int64_t heads, int64_t dim) {
  return {c.max_segments, heads, dim, sequence_rows(c)};
}
Dims transposed_strides(const CudnnSdpaConfig& c, int64_t heads, int64_t dim) {
  const int64_t S = sequence_rows(c);
  return {S * heads * dim, dim, 1, heads * dim};
}
// lse [T, Hq] seen as [N, Hq, S, 1].
Dims stats_dims(const CudnnSdpaConfig& c) { return {c.max_segments, c.num_q_heads, sequence_rows(c), 1}; }
Dims stats_strides(const CudnnSdpaConfig& c) {
  const int64_t H = c.num_q_heads, S = sequence_rows(c);
  return {S * H, 1, H, 1};
}

// Scores outside each sequence's [0, len_q) x [0, len_kv) get -inf (the ragged layout's padding
// mask; cuDNN requires it with ragged offsets).
int64_t padding_mask(Graph& g, const ScoreShapes& s, const CudnnSdpa::Impl::Uids& u, int64_t scores,
                     const float* negative_infinity, const std::string& tag) {
  const int64_t row = g.virt(tag + "padding row index", CUDNN_DATA_INT32, s.scores, s.scores_strides);
  g.pointwise(tag + "gen_row_idx_padding", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, scores, -1, -1, row, 2);
  const int64_t col = g.virt(tag + "padding col index", CUDNN_DATA_INT32, s.scores, s.scores_strides);
  g.pointwise(tag + "gen_col_idx_padding", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, scores, -1, -1, col, 3);
  const int64_t row_ok = g.virt(tag + "row < seq_len_q", CUDNN_DATA_BOOLEAN, s.scores, s.scores_strides);
  g.pointwise(tag + "lt_row_sq_padding", CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, row, u.seq_len_q, -1, row_ok);
  const int64_t col_ok = g.virt(tag + "col < seq_len_kv", CUDNN_DATA_BOOLEAN, s.scores, s.scores_strides);
  g.pointwise(tag + "lt_col_skv_padding", CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, col, u.seq_len_kv, -1,
              col_ok);
  const int64_t inside = g.virt(tag + "inside", CUDNN_DATA_BOOLEAN, s.scores, s.scores_strides);
  g.pointwise(tag + "and_row_col_padding", CUDNN_POINTWISE_LOGICAL_AND, CUDNN_DATA_BOOLEAN, row_ok, col_ok, -1,
              inside);
  const int64_t fill = g.scalar(tag + "padding -inf", negative_infinity);
  const int64_t masked = g.virt(tag + "padded scores", CUDNN_DATA_FLOAT, s.scores, s.scores_strides);
  g.pointwise(tag + "select_padding", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, scores, fill, inside, masked);
  return masked;
}

// Top-left causal within each sequence: keep row >= col.
int64_t causal_mask(Graph& g, const ScoreShapes& s, int64_t scores, const float* negative_infinity,
                    const std::string& tag) {
  const int64_t row = g.virt(tag + "causal row index", CUDNN_DATA_INT32, s.scores, s.scores_strides);
  g.pointwise(tag + "gen_row_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, scores, -1, -1, row, 2);
  const int64_t col = g.virt(tag + "causal col index", CUDNN_DATA_INT32, s.scores, s.scores_strides);
  g.pointwise(tag + "gen_col_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, scores, -1, -1, col, 3);
  const int64_t keep = g.virt(tag + "row >= col", CUDNN_DATA_BOOLEAN, s.scores, s.scores_strides);
  g.pointwise(tag + "row>=col", CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, -1, keep);
  const int64_t fill = g.scalar(tag + "causal -inf", negative_infinity);
  const int64_t masked = g.virt(tag + "causal scores", CUDNN_DATA_FLOAT, s.scores, s.scores_strides);
  g.pointwise(tag + "binary_select", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, scores, fill, keep, masked);
  return masked;
}

void build_forward(CudnnSdpa::Impl& impl, const CudnnSdpaConfig& c) {
  Graph& g = impl.forward_graph;
  CudnnSdpa::Impl::Uids& u = impl.fwd;
  const ScoreShapes s = score_shapes(c);
  add_batch_arrays(g, c, u);
  const int64_t Hq = c.num_q_heads, Hkv = c.num_kv_heads, D = c.head_dim, Dv = value_dim(c);
  u.q = g.tensor("Q", CUDNN_DATA_BFLOAT16, rows_dims(c, Hq, D), rows_strides(c, Hq, D), false, u.offsets_q);
  u.k = g.tensor("K^T", CUDNN_DATA_BFLOAT16, transposed_dims(c, Hkv, D), transposed_strides(c, Hkv, D), false,
                 u.offsets_k);
  u.v = g.tensor("V", CUDNN_DATA_BFLOAT16, rows_dims(c, Hkv, Dv), rows_strides(c, Hkv, Dv), false, u.offsets_v);
  u.o = g.tensor("O", CUDNN_DATA_BFLOAT16, rows_dims(c, Hq, Dv), rows_strides(c, Hq, Dv), false, u.offsets_o);
  u.stats = g.tensor("Stats", CUDNN_DATA_FLOAT, stats_dims(c), stats_strides(c), false, u.offsets_stats);
  const int64_t scale = g.scalar("attn_scale", &impl.scale);

  const int64_t s_raw = g.virt("Q K^T", CUDNN_DATA_FLOAT, s.scores, s.scores_strides);
  g.matmul("bmm1", u.q, u.k, s_raw, u.seq_len_q, u.seq_len_kv, -1);
  int64_t scores = g.virt("scaled scores", CUDNN_DATA_FLOAT, s.scores, s.scores_strides);
  g.pointwise("attn_scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s_raw, scale, -1, scores);
  scores = padding_mask(g, s, u, scores, &impl.negative_infinity, "");
  if (c.causal) scores = causal_mask(g, s, scores, &impl.negative_infinity, "");

  // Softmax with the statistics output: Stats = max + log(sum exp(x - max)).
  const int64_t max = g.virt("row max", CUDNN_DATA_FLOAT, s.rows, s.rows_strides);
  g.reduction("Max", CUDNN_REDUCE_TENSOR_MAX, scores, max);
  const int64_t centred = g.virt("x - max", CUDNN_DATA_FLOAT, s.scores, s.scores_strides);
  g.pointwise("sub", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, scores, max, -1, centred);
  const int64_t exps = g.virt("exp", CUDNN_DATA_FLOAT, s.scores, s.scores_strides);
  g.pointwise("exp", CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, centred, -1, -1, exps);
  const int64_t sum = g.virt("row sum", CUDNN_DATA_FLOAT, s.rows, s.rows_strides);
  g.reduction("sum", CUDNN_REDUCE_TENSOR_ADD, exps, sum);
  const int64_t log_sum = g.virt("log sum", CUDNN_DATA_FLOAT, s.rows, s.rows_strides);
  g.pointwise("log", CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, sum, -1, -1, log_sum);
  g.pointwise("add", CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, max, log_sum, -1, u.stats);
  const int64_t probs = g.virt("P (bf16)", CUDNN_DATA_BFLOAT16, s.scores, s.scores_strides);
  g.pointwise("div", CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, exps, sum, -1, probs);

  g.matmul("bmm2", probs, u.v, u.o, u.seq_len_q, -1, u.seq_len_kv);
}

void build_backward(CudnnSdpa::Impl& impl, const CudnnSdpaConfig& c) {
  Graph& g = impl.backward_graph;
  CudnnSdpa::Impl::Uids& u = impl.bwd;
  const ScoreShapes s = score_shapes(c);
  const int64_t Hq = c.num_q_heads, Hkv = c.num_kv_heads, S = sequence_rows(c), D = c.head_dim;
  const int64_t Dv = value_dim(c);
  const bool grouped = c.num_q_heads != c.num_kv_heads;
  add_batch_arrays(g, c, u);
  u.q = g.tensor("Q", CUDNN_DATA_BFLOAT16, rows_dims(c, Hq, D), rows_strides(c, Hq, D), false, u.offsets_q);
  u.k = g.tensor("K^T", CUDNN_DATA_BFLOAT16, transposed_dims(c, Hkv, D), transposed_strides(c, Hkv, D), false,
                 u.offsets_k);
  u.v = g.tensor("V^T", CUDNN_DATA_BFLOAT16, transposed_dims(c, Hkv, Dv), transposed_strides(c, Hkv, Dv), false,
                 u.offsets_v);
  u.o = g.tensor("O", CUDNN_DATA_BFLOAT16, rows_dims(c, Hq, Dv), rows_strides(c, Hq, Dv), false, u.offsets_o);
  u.d_o = g.tensor("dO", CUDNN_DATA_BFLOAT16, rows_dims(c, Hq, Dv), rows_strides(c, Hq, Dv), false, u.offsets_o);
  u.stats = g.tensor("Stats", CUDNN_DATA_FLOAT, stats_dims(c), stats_strides(c), false, u.offsets_stats);
  u.dq = g.tensor("dQ", CUDNN_DATA_BFLOAT16, rows_dims(c, Hq, D), rows_strides(c, Hq, D), false, u.offsets_q);
  u.dk = g.tensor("dK", CUDNN_DATA_BFLOAT16, rows_dims(c, Hkv, D), rows_strides(c, Hkv, D), false, u.offsets_k);
  u.dv = g.tensor("dV", CUDNN_DATA_BFLOAT16, rows_dims(c, Hkv, Dv), rows_strides(c, Hkv, Dv), false, u.offsets_v);
  const int64_t scale = g.scalar("attn_scale", &impl.scale);
  const int64_t one = g.scalar("one", &impl.one);

  // softmax_sum = rowsum(dO * O), kept in the workspace in the Stats layout.
  const int64_t d_o_o = g.virt("dO * O", CUDNN_DATA_FLOAT, rows_dims(c, Hq, Dv), {Hq * S * Dv, S * Dv, Hq * Dv, 1});
  g.pointwise("mul_dO_O", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, u.d_o, u.o, -1, d_o_o);
  const int64_t row_sum = g.virt("rowsum(dO * O)", CUDNN_DATA_FLOAT, s.rows, s.rows_strides);
  g.reduction("reduce_dO_o", CUDNN_REDUCE_TENSOR_ADD, d_o_o, row_sum);
  u.softmax_sum = g.tensor("softmax_sum", CUDNN_DATA_FLOAT, stats_dims(c), stats_strides(c), false, u.offsets_stats);
  g.pointwise("scale_dropout_inv", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, row_sum, one, -1, u.softmax_sum);

  // P = exp(scale * Q K^T - Stats), masked.
  const int64_t s_raw = g.virt("Q K^T", CUDNN_DATA_FLOAT, s.scores, s.scores_strides);
  g.matmul("matmul_Q_KT", u.q, u.k, s_raw, u.seq_len_q, u.seq_len_kv, -1);
  int64_t scores = g.virt("scaled scores", CUDNN_DATA_FLOAT, s.scores, s.scores_strides);
  g.pointwise("mul_s_attn_scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s_raw, scale, -1, scores);
  scores = padding_mask(g, s, u, scores, &impl.negative_infinity, "bwd ");
  const int64_t centred = g.virt("s - stats", CUDNN_DATA_FLOAT, s.scores, s.scores_strides);
  g.pointwise("sub_s_m", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, scores, u.stats, -1, centred);
  scores = centred;
  if (c.causal) scores = causal_mask(g, s, scores, &impl.negative_infinity, "bwd ");
  const int64_t probs = g.virt("P", CUDNN_DATA_FLOAT, s.scores, s.scores_strides);
  g.pointwise("exp_s", CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, scores, -1, -1, probs);

  // dV = P^T dO (summed over each KV head's query heads for GQA).
  const int64_t probs_t = g.virt("P^T (bf16)", CUDNN_DATA_BFLOAT16, s.scores, s.transposed_strides);
  g.reshape("reshape_p", probs, probs_t);
  // GQA: dV and dK per query head, summed over each KV head's group by the graph. Those per-head
  // tensors live in the workspace packed as [T, Hq, dim] rows at dV's and dK's ragged offsets, which
  // cuDNN scales by Hq / Hkv (cudnn-frontend's packed layout for them): as virtual tensors they were
  // padded to [N, Hq, S, dim], 134 MB of plan scratch a sequence slot at 8,192 tokens and 16 query
  // heads of 256, so a plan for a packed micro-batch of many samples did not fit.
  if (grouped) {
    u.dv_full = g.tensor("dV per query head", CUDNN_DATA_BFLOAT16, rows_dims(c, Hq, Dv), rows_strides(c, Hq, Dv),
                         false, u.offsets_v);
    g.matmul("matmul_pT_dO", probs_t, u.d_o, u.dv_full, u.seq_len_kv, -1, u.seq_len_q);
    g.reduction("red_dV_head", CUDNN_REDUCE_TENSOR_ADD, u.dv_full, u.dv);
  } else {
    g.matmul("matmul_pT_dO", probs_t, u.d_o, u.dv, u.seq_len_kv, -1, u.seq_len_q);
  }

  // dS = P * (dO V^T - softmax_sum) * scale.
  const int64_t dp = g.virt("dO V^T", CUDNN_DATA_FLOAT, s.scores, s.scores_strides);
  g.matmul("matmul_dO_VT", u.d_o, u.v, dp, u.seq_len_q, u.seq_len_kv, -1);
  const int64_t dp_centred = g.virt("dP - softmax_sum", CUDNN_DATA_FLOAT, s.scores, s.scores_strides);
  g.pointwise("sub_dP_softmax_sum", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, dp, u.softmax_sum, -1, dp_centred);
  const int64_t ds_unscaled = g.virt("P * (dP - sum)", CUDNN_DATA_FLOAT, s.scores, s.scores_strides);
  g.pointwise("mul_dP_exp_s", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dp_centred, probs, -1, ds_unscaled);
  const int64_t ds = g.virt("dS", CUDNN_DATA_FLOAT, s.scores, s.scores_strides);
  g.pointwise("mul_dS_attn_scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, ds_unscaled, scale, -1, ds);

  // dK = dS^T Q.
  const int64_t ds_t = g.virt("dS^T (bf16)", CUDNN_DATA_BFLOAT16, s.scores, s.transposed_strides);
  g.reshape("reshape_dS", ds, ds_t);
  if (grouped) {
    u.dk_full = g.tensor("dK per query head", CUDNN_DATA_BFLOAT16, rows_dims(c, Hq, D), rows_strides(c, Hq, D), false,
                         u.offsets_k);
    g.matmul("matmul_dST_Q", ds_t, u.q, u.dk_full, u.seq_len_kv, -1, u.seq_len_q);
    g.reduction("red_dK_head", CUDNN_REDUCE_TENSOR_ADD, u.dk_full, u.dk);
  } else {
    g.matmul("matmul_dST_Q", ds_t, u.q, u.dk, u.seq_len_kv, -1, u.seq_len_q);
  }

  // dQ = dS K, accumulated in fp32 in the workspace, then written as bf16.
  const int64_t k_rows = g.virt("K (view of K^T)", CUDNN_DATA_BFLOAT16, rows_dims(c, Hkv, D), rows_strides(c, Hkv, D),
                                 u.offsets_k);
  g.reshape("reshape_k", u.k, k_rows);
  u.dq_accum = g.tensor("dQ accumulator", CUDNN_DATA_FLOAT, rows_dims(c, Hq, D), rows_strides(c, Hq, D), false,
                        u.offsets_q);
  g.matmul("matmul_dS_K", ds, k_rows, u.dq_accum, u.seq_len_q, -1, u.seq_len_kv);
  g.pointwise("identity_dQ", CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, u.dq_accum, -1, -1, u.dq);
}

// Each batch array starts on its own 256-byte boundary (the descriptors promise 16-byte
// alignment for every tensor).
size_t batch_array_stride(const CudnnSdpaConfig& c) {
  return align_up(sizeof(int32_t) * static_cast<size_t>(c.max_segments + 1));
}
size_t batch_array_bytes(const CudnnSdpaConfig& c) { return 6 * batch_array_stride(c); }
size_t softmax_sum_bytes(const CudnnSdpaConfig& c) {
  return align_up(sizeof(float) * static_cast<size_t>(c.max_tokens * c.num_q_heads));
}
size_t dq_accum_bytes(const CudnnSdpaConfig& c) {
  return align_up(sizeof(float) * static_cast<size_t>(c.max_tokens * c.num_q_heads * c.head_dim));
}
// The grouped backward's per-query-head dK [T, Hq, D] or dV [T, Hq, Dv] (bf16 tensors; sized at 4
// bytes an element, as cudnn-frontend sizes them, in case an engine keeps them in fp32); none without
// grouped heads.
size_t full_head_bytes(const CudnnSdpaConfig& c, int64_t dim) {
  if (c.num_q_heads == c.num_kv_heads) return 0;
  return align_up(sizeof(float) * static_cast<size_t>(c.max_tokens * c.num_q_heads * dim));
}
size_t full_heads_bytes(const CudnnSdpaConfig& c) {
  return full_head_bytes(c, c.head_dim) + full_head_bytes(c, value_dim(c));
}

std::string describe(const CudnnSdpaConfig& c) {
  return str_cat("T=", c.max_tokens, c.max_sequence_tokens > 0 ? str_cat(" S=", c.max_sequence_tokens) : std::string(),
                 " N=", c.max_segments, " Hq=", c.num_q_heads, " Hkv=", c.num_kv_heads,
                 " D=", c.head_dim, c.value_dim > 0 ? str_cat(" Dv=", c.value_dim) : std::string(),
                 c.causal ? " causal" : " non-causal");
}

}  // namespace

std::unique_ptr<CudnnSdpa> CudnnSdpa::create(const CudnnSdpaConfig& config, std::string* why_not) {
  const CudnnSdpaConfig& c = config;
  auto refuse = [&](const std::string& reason) -> std::unique_ptr<CudnnSdpa> {
    if (why_not != nullptr) *why_not = "cuDNN SDPA (" + describe(c) + "): " + reason;
    return nullptr;
  };
  if (c.max_tokens < 1 || c.max_segments < 1 || c.num_q_heads < 1 || c.num_kv_heads < 1 ||
      c.num_q_heads % c.num_kv_heads != 0 || c.max_sequence_tokens < 0 || c.max_sequence_tokens > c.max_tokens)
    return refuse("bad sizes");
  if (c.head_dim < 8 || c.head_dim > 256 || c.head_dim % 8 != 0)
    return refuse("head dim must be a multiple of 8 in [8, 256] for the fused kernels");
  if (c.value_dim != 0 && (c.value_dim < 8 || c.value_dim > 256 || c.value_dim % 8 != 0))
    return refuse("value head dim must be 0 (= D) or a multiple of 8 in [8, 256]");
  // The backward's fp32 dQ accumulator follows dQ's packed rows ([T, Hq, D] at dQ's ragged offsets);
  // at D = 72 cuDNN 9.19 got dQ wrong that way on the H200 (rel. L2 1.2 against the CPU reference;
  // out, lse, dK, dV right; padding the accumulator's rows to 80 or 128 floats did not help), and
  // cudnn-frontend avoids that layout when D is not a multiple of 16. Callers zero-pad Q and K to
  // the next multiple of 16 (the vision tower: D = 80, Dv = 72).
  if (c.head_dim % 16 != 0)
    return refuse("the query/key head dim must be a multiple of 16 (cuDNN's packed dQ accumulator is wrong otherwise; "
                  "zero-pad Q and K)");
  if (c.max_tokens * c.num_q_heads * std::max(c.head_dim, value_dim(c)) >= (int64_t{1} << 31))
    return refuse("element offsets past int32 (T * Hq * D >= 2^31)");
  if (c.max_segments > 1 << 20) return refuse("too many sequences per call");
  // Used with the sm_90a kernels only (kernels/common/kernel_path_cuda.h): off Hopper cuDNN has no
  // d = 256 backward, and a binary running the sm_80 kernels on an H200 takes the A800's path.
  const KernelPath& path = kernel_path();
  if (!path.sm90a)
    return refuse(str_cat("the ", path.describe(), " kernel path (GPU sm_", path.device_arch,
                          "): used with the sm_90a kernels only (Hopper; d = 256 backward)"));
  const size_t version = cudnnGetVersion();
  if (version < 90600) return refuse(str_cat("cuDNN ", version, " < 9.6 (GQA with ragged offsets)"));

  auto impl = std::make_unique<Impl>();
  impl->scale = c.scale;
  try {
    CUDNN_CHECK(cudnnCreate(&impl->handle));
    build_forward(*impl, c);
    impl->forward_plan = impl->forward_graph.build_plan(impl->handle, &impl->forward_plan_workspace);
    build_backward(*impl, c);
    impl->backward_plan = impl->backward_graph.build_plan(impl->handle, &impl->backward_plan_workspace);
  } catch (const Error& e) {
    return refuse(e.what());
  }
  impl->batch_array_bytes = batch_array_bytes(c);
  impl->softmax_sum_bytes = softmax_sum_bytes(c);
  impl->dq_accum_bytes = dq_accum_bytes(c);
  impl->full_heads_bytes = full_heads_bytes(c);
  std::unique_ptr<CudnnSdpa> sdpa(new CudnnSdpa(config, std::move(impl)));
  if (c.max_segments > kCudnnNarrowSegments) {
    CudnnSdpaConfig narrow = c;
    narrow.max_segments = kCudnnNarrowSegments;
    sdpa->narrow_ = create(narrow, why_not);
    if (sdpa->narrow_ == nullptr) return nullptr;  // why_not says why
  }
  if (c.sequence_plans) {
    CudnnSdpaConfig shorter = c;
    shorter.sequence_plans = false;
    for (int64_t rows = kCudnnShortestSequencePlan; rows < sequence_rows(c); rows *= 2) {
      shorter.max_sequence_tokens = rows;
      // A plan cuDNN will not build for a shorter S leaves those calls on the longer plans (said once).
      std::string skipped;
      if (auto plans = create(shorter, &skipped))
        sdpa->shorter_.push_back(std::move(plans));
      else
        log_warn(skipped, "; sequences of up to ", rows, " rows take the plans for more");
    }
  }
  return sdpa;
}

int64_t CudnnSdpa::plan_sequence_rows(int64_t num_segments, int64_t longest_sequence) const {
  return sequence_rows(plans_for(num_segments, longest_sequence).config());
}

const CudnnSdpa& CudnnSdpa::plans_for(int64_t num_segments, int64_t longest_sequence) const {
  if (narrow_ != nullptr && num_segments <= narrow_->config().max_segments)
    return narrow_->plans_for(num_segments, longest_sequence);
  if (longest_sequence > 0) {
    for (const auto& plans : shorter_)
      if (longest_sequence <= plans->config().max_sequence_tokens) return *plans;
  }
  return *this;
}

CudnnSdpa::CudnnSdpa(const CudnnSdpaConfig& config, std::unique_ptr<Impl> impl)
    : config_(config), impl_(std::move(impl)) {}

CudnnSdpa::~CudnnSdpa() = default;

int64_t CudnnSdpa::plans_built() { return g_plans_built.load(); }

size_t CudnnSdpa::fixed_workspace_bytes(const CudnnSdpaConfig& config) {
  return batch_array_bytes(config) + softmax_sum_bytes(config) + dq_accum_bytes(config) + full_heads_bytes(config);
}

size_t CudnnSdpa::forward_workspace_bytes() const {
  size_t bytes = impl_->batch_array_bytes + align_up(static_cast<size_t>(impl_->forward_plan_workspace));
  if (narrow_ != nullptr) bytes = std::max(bytes, narrow_->forward_workspace_bytes());
  for (const auto& plans : shorter_) bytes = std::max(bytes, plans->forward_workspace_bytes());
  return bytes;
}

size_t CudnnSdpa::backward_workspace_bytes() const {
  size_t bytes = impl_->batch_array_bytes + impl_->softmax_sum_bytes + impl_->dq_accum_bytes +
                 impl_->full_heads_bytes + align_up(static_cast<size_t>(impl_->backward_plan_workspace));
  if (narrow_ != nullptr) bytes = std::max(bytes, narrow_->backward_workspace_bytes());
  for (const auto& plans : shorter_) bytes = std::max(bytes, plans->backward_workspace_bytes());
  return bytes;
}

namespace {

// The batch arrays at the head of the workspace, each 256-byte aligned: seq_len (used for q
// and kv) [N], then the q, kv and stats offsets [N + 1] each.
struct BatchArrays {
  int32_t *seq_len, *offsets_q, *offsets_k, *offsets_o, *offsets_v, *offsets_stats;
};

BatchArrays fill_batch_arrays(const CudnnSdpaConfig& c, void* workspace, const int32_t* cu_seqlens,
                              int64_t num_segments, cudaStream_t stream) {
  char* base = static_cast<char*>(workspace);
  const size_t stride = batch_array_stride(c);
  auto array = [&](int index) { return reinterpret_cast<int32_t*>(base + index * stride); };
  const int64_t N = c.max_segments;
  BatchArrays a{array(0), array(1), array(2), array(3), array(4), array(5)};
  const int64_t Dv = value_dim(c);
  cudnn_sdpa_batch_arrays_cuda(cu_seqlens, num_segments, N,
                               {c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_q_heads * Dv,
                                c.num_kv_heads * Dv, c.num_q_heads},
                               a.seq_len, {a.offsets_q, a.offsets_k, a.offsets_o, a.offsets_v, a.offsets_stats},
                               stream);
  return a;
}

void check_workspace(const void* workspace, size_t bytes, size_t needed, const char* where) {
  CHECK(bytes >= needed, where, ": workspace of ", bytes, " bytes, the plan needs ", needed);
  CHECK(reinterpret_cast<uintptr_t>(workspace) % kAlign == 0, where, ": workspace not ", kAlign, "-byte aligned");
}

void check_aligned(const void* p, const char* name, const char* where) {
  CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, where, ": ", name, " is not 16-byte aligned");
}

// What every execution of a graph takes: its by-value scalars, the batch arrays (one length array
// serves Q and KV), Q, K, V, O and the row statistics.
VariantPack common_pack(const Graph& graph, const CudnnSdpa::Impl::Uids& u, const BatchArrays& a, const void* q,
                        const void* k, const void* v, const void* o, const float* stats) {
  VariantPack pack;
  for (const auto& [uid, value] : graph.by_value()) pack.add(uid, value);
  const std::initializer_list<std::pair<int64_t, const void*>> entries{
      {u.seq_len_q, a.seq_len}, {u.seq_len_kv, a.seq_len}, {u.offsets_q, a.offsets_q},
      {u.offsets_k, a.offsets_k}, {u.offsets_o, a.offsets_o}, {u.offsets_v, a.offsets_v},
      {u.offsets_stats, a.offsets_stats}, {u.q, q}, {u.k, k}, {u.v, v}, {u.o, o}, {u.stats, stats}};
  for (const auto& [uid, pointer] : entries) pack.add(uid, pointer);
  return pack;
}

}  // namespace

void CudnnSdpa::forward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                        const int32_t* cu_seqlens, int64_t num_segments, __nv_bfloat16* out, float* lse,
                        void* workspace, size_t workspace_bytes, cudaStream_t stream,
                        int64_t longest_sequence) const {
  constexpr const char* where = "cuDNN SDPA forward";
  const CudnnSdpa& plans = plans_for(num_segments, longest_sequence);
  if (&plans != this) {
    plans.forward(q, k, v, cu_seqlens, num_segments, out, lse, workspace, workspace_bytes, stream);
    return;
  }
  check_workspace(workspace, workspace_bytes, forward_workspace_bytes(), where);
  const std::initializer_list<std::pair<const void*, const char*>> pointers_to_check{
      {q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {lse, "lse"}};
  for (const auto& [p, name] : pointers_to_check) check_aligned(p, name, where);
  const BatchArrays a = fill_batch_arrays(config_, workspace, cu_seqlens, num_segments, stream);
  const VariantPack pack = common_pack(impl_->forward_graph, impl_->fwd, a, q, k, v, out, lse);
  void* plan_workspace = static_cast<char*>(workspace) + impl_->batch_array_bytes;
  CUDNN_CHECK(cudnnSetStream(impl_->handle, stream));
  pack.execute(impl_->handle, impl_->forward_plan, plan_workspace, where);
}

void CudnnSdpa::backward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                         const __nv_bfloat16* out, const float* lse, const __nv_bfloat16* d_out,
                         const int32_t* cu_seqlens, int64_t num_segments, __nv_bfloat16* dq, __nv_bfloat16* dk,
                         __nv_bfloat16* dv, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                         int64_t longest_sequence) const {
  constexpr const char* where = "cuDNN SDPA backward";
  const CudnnSdpa& plans = plans_for(num_segments, longest_sequence);
  if (&plans != this) {
    plans.backward(q, k, v, out, lse, d_out, cu_seqlens, num_segments, dq, dk, dv, workspace, workspace_bytes, stream);
    return;
  }
  check_workspace(workspace, workspace_bytes, backward_workspace_bytes(), where);
  const std::initializer_list<std::pair<const void*, const char*>> pointers_to_check{
      {q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {lse, "lse"}, {d_out, "d_out"}, {dq, "dq"}, {dk, "dk"}, {dv, "dv"}};
  for (const auto& [p, name] : pointers_to_check) check_aligned(p, name, where);
  const BatchArrays a = fill_batch_arrays(config_, workspace, cu_seqlens, num_segments, stream);
  char* cursor = static_cast<char*>(workspace) + impl_->batch_array_bytes;
  void* softmax_sum = cursor;
  cursor += impl_->softmax_sum_bytes;
  void* dq_accum = cursor;
  cursor += impl_->dq_accum_bytes;
  // Grouped heads: dK, then dV per query head (full_heads_bytes), before the plan's own scratch.
  void* dk_full = cursor;
  void* dv_full = cursor + full_head_bytes(config_, config_.head_dim);
  cursor += impl_->full_heads_bytes;
  // The accumulator is not cleared here: cuDNN >= 9.6 (create() refuses older ones) initialises it
  // itself, as cudnn-frontend relies on; a memset cost 9 us a vision block and ~0.05 ms at T =
  // 8,192. cudnn_sdpa_gpu_test runs every backward on a workspace filled with NaN to hold it to that.
  const Impl::Uids& u = impl_->bwd;
  VariantPack pack = common_pack(impl_->backward_graph, u, a, q, k, v, out, lse);
  const std::initializer_list<std::pair<int64_t, const void*>> gradients{
      {u.d_o, d_out}, {u.dq, dq}, {u.dk, dk}, {u.dv, dv}, {u.softmax_sum, softmax_sum}, {u.dq_accum, dq_accum}};
  for (const auto& [uid, pointer] : gradients) pack.add(uid, pointer);
  if (impl_->full_heads_bytes > 0) {
    pack.add(u.dk_full, dk_full);
    pack.add(u.dv_full, dv_full);
  }
  CUDNN_CHECK(cudnnSetStream(impl_->handle, stream));
  pack.execute(impl_->handle, impl_->backward_plan, cursor, where);
}

}  // namespace deltamoe
