// The one pybind11 module, pyserve._C. Ops are chosen by the device of their tensors; Python
// reaches them only through pyserve/_native.py.
#include <torch/extension.h>
#include <pybind11/numpy.h>

#include <omp.h>

#include <array>

#include "comm/shm_communicator.h"
#include "cpu/decoder_layer.h"
#include "cpu/ngram.h"
#include "cpu/ops.h"
#include "kv/block_pool.h"
#ifdef PYSERVE_CUDA
#include "cuda/graphs.h"
#include "cuda/nccl_communicator.h"
#include "cuda/ops.h"
#endif

namespace pyserve {
namespace {

// The calling thread's parallel regions run on at most `threads` threads (its own OpenMP
// thread count; torch's process-wide count, and so the model thread's, stays); returns the
// count it had. libgomp spins at a team's barriers only while it manages no more threads than
// the machine has CPUs; one more team (say the event loop's, made by a large index op while
// preparing a step) and every team sleeps and is woken through the kernel at every region,
// which cost Gemma 3's W2 a futex sleep per region of each step's few hundred.
int64_t limit_parallel_regions(int64_t threads) {
  TORCH_CHECK(threads > 0, "limit_parallel_regions: threads must be positive");
  // torch's per-thread set-up first, or the first parallel region after this would redo it
  // and undo the limit: libtorch's (inside get_num_threads) and this extension's own copy of
  // the inline lazy_init_num_threads, whose once-per-thread flag is private to each library
  const int64_t before = at::get_num_threads();
  at::internal::lazy_init_num_threads();
  omp_set_num_threads(static_cast<int>(threads));
  return before;
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
#ifdef PYSERVE_CUDA
  if (key.is_cuda()) {
    TORCH_CHECK(key_cache.device() == key.device() && slot_mapping.device() == key.device(),
                "reshape_and_cache: all tensors must be on one device");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
    TORCH_CHECK(key_cache.scalar_type() == key.scalar_type(),
                "reshape_and_cache (CUDA): the caches must have the keys' dtype");
    // the kernel writes value_cache with key_cache's strides
    TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes() &&
                    value_cache.strides() == key_cache.strides() && key_cache.size(1) == key.size(1) &&
                    key_cache.size(3) == key.size(2) && value_cache.device() == key.device() &&
                    value.device() == key.device(),
                "reshape_and_cache (CUDA): the caches must both be [num_blocks, num_kv_heads, "
                "block_size, head_size] with one layout, on key's device");
    return cuda::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
  }
#endif
  TORCH_CHECK(key.device().is_cpu(), "reshape_and_cache: no kernel for device ", key.device());
  cpu::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
}

void check_paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache must both be [num_blocks, num_kv_heads, block_size, head_size]");
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "the caches must be contiguous in head_size");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [num_tokens, num_heads, head_size]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1, "out must match query");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "query head_size differs from the cache's");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type() &&
                  cpu::cache_types_match(query.scalar_type(), key_cache.scalar_type()),
              "query and out must share one dtype, the caches another: the same, or bfloat16, "
              "float16 or float8_e5m2 caches for a float32 query");
  for (const at::Tensor* t : {&out, &key_cache, &value_cache, &block_tables, &query_start_loc, &seq_lens})
    TORCH_CHECK(t->device() == query.device(), "paged_attention: all tensors must be on one device");
  for (const at::Tensor* t : {&block_tables, &query_start_loc, &seq_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt, "block_tables, query_start_loc and seq_lens must be int32");
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1,
              "metadata tensors must be contiguous");
  TORCH_CHECK(query_start_loc.numel() == seq_lens.numel() + 1 && block_tables.size(0) >= seq_lens.numel(),
              "query_start_loc needs num_seqs + 1 entries and block_tables num_seqs rows");
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                     int64_t window, double softcap) {
  check_paged_attention(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens);
#ifdef PYSERVE_CUDA
  if (query.is_cuda()) {
    TORCH_CHECK(key_cache.scalar_type() == query.scalar_type(),
                "paged_attention (CUDA): the caches must have the query's dtype");
    // the kernel addresses both caches with key_cache's strides, rows head_size apart
    TORCH_CHECK(key_cache.strides() == value_cache.strides() && key_cache.stride(2) == key_cache.size(3),
                "paged_attention (CUDA): key_cache and value_cache must share one layout, rows "
                "head_size apart");
    return cuda::paged_attention(out, query, key_cache, value_cache, block_tables, query_start_loc,
                                 seq_lens, scale, window, softcap);
  }
#endif
  TORCH_CHECK(query.device().is_cpu(), "paged_attention: no kernel for device ", query.device());
  cpu::paged_attention(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                       scale, window, softcap);
}

// The fused layer ops: CUDA kernels for CUDA tensors, the CPU twins otherwise.
#ifdef PYSERVE_CUDA
#define PYSERVE_DISPATCH(tensor, call) \
  if ((tensor).is_cuda()) return cuda::call; \
  return cpu::call;
#else
#define PYSERVE_DISPATCH(tensor, call) \
  TORCH_CHECK((tensor).device().is_cpu(), "no kernel for device ", (tensor).device()); \
  return cpu::call;
#endif

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  PYSERVE_DISPATCH(input, rms_norm(out, input, weight, epsilon))
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double epsilon) {
  PYSERVE_DISPATCH(input, fused_add_rms_norm(input, residual, weight, epsilon))
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, std::optional<at::Tensor> key,
                      int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  PYSERVE_DISPATCH(query, rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox))
}

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  PYSERVE_DISPATCH(input, silu_and_mul(out, input))
}

std::tuple<at::Tensor, at::Tensor> moe_sort_rows(const at::Tensor& topk_ids, int64_t num_experts) {
  PYSERVE_DISPATCH(topk_ids, moe_sort_rows(topk_ids, num_experts))
}

void moe_combine(at::Tensor& out, const at::Tensor& y, const at::Tensor& row_of,
                 const at::Tensor& topk_ids, const at::Tensor& topk_weights) {
  PYSERVE_DISPATCH(out, moe_combine(out, y, row_of, topk_ids, topk_weights))
}

#undef PYSERVE_DISPATCH

bool built_with_cuda() {
#ifdef PYSERVE_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace pyserve

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  using pyserve::BlockPool;
  m.doc() = "pyserve native core: KV block pool and attention kernels";

  py::class_<BlockPool>(m, "BlockPool")
      .def(py::init([](int64_t num_blocks, const std::string& order) {
             if (order != "lru" && order != "resident")
               throw std::invalid_argument("BlockPool order must be 'lru' or 'resident', not '" + order + "'");
             return BlockPool(num_blocks, order == "lru" ? pyserve::BlockOrder::kLru
                                                         : pyserve::BlockOrder::kResident);
           }),
           py::arg("num_blocks"), py::arg("order") = "lru")
      .def("allocate", &BlockPool::allocate, py::arg("n"))
      .def("free", &BlockPool::free, py::arg("block_ids"))
      .def("ref_count", &BlockPool::ref_count, py::arg("block_id"))
      .def("lookup", [](const BlockPool& p, py::bytes hash) { return p.lookup(std::string(hash)); },
           py::arg("block_hash"))
      .def("acquire", &BlockPool::acquire, py::arg("block_ids"))
      .def("cache", [](BlockPool& p, int64_t id, py::bytes hash) { return p.cache(id, std::string(hash)); },
           py::arg("block_id"), py::arg("block_hash"))
      .def_property_readonly("num_blocks", &BlockPool::num_blocks)
      .def_property_readonly("num_free", &BlockPool::num_free)
      // Inspection only (tests and benchmarks read them; the engine never does):
      .def("incref", &BlockPool::incref, py::arg("block_ids"))
      .def("free_queue", &BlockPool::free_queue)
      .def_property_readonly("num_cached", &BlockPool::num_cached)
      .def_property_readonly("num_evictions", &BlockPool::num_evictions)
      .def_property_readonly("num_touched", &BlockPool::num_touched);

  m.def("reshape_and_cache", &pyserve::reshape_and_cache, py::arg("key"), py::arg("value"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"));
  m.def("paged_attention", &pyserve::paged_attention, py::arg("out"), py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0, py::call_guard<py::gil_scoped_release>());
  m.def("pack_linear_weight", &pyserve::cpu::pack_linear_weight, py::arg("weight"),
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_gguf_weight", &pyserve::cpu::pack_gguf_weight, py::arg("blocks"), py::arg("k"),
        py::arg("type"), py::arg("int8_activations") = false, py::call_guard<py::gil_scoped_release>());
  m.def("int8_dot_supported", &pyserve::cpu::int8_dot_supported);
  m.def("encoder_attention_supported", &pyserve::cpu::encoder_attention_supported, py::arg("head_size"));
  m.def("encoder_attention", &pyserve::cpu::encoder_attention, py::arg("out"), py::arg("qkv"),
        py::arg("query_start_loc"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("bf16x3_supported", &pyserve::cpu::bf16x3_supported);
  m.def("pack_bf16x3_weight", &pyserve::cpu::pack_bf16x3_weight, py::arg("weight"),
        py::call_guard<py::gil_scoped_release>());
  m.def("bf16x3_linear", &pyserve::cpu::bf16x3_linear, py::arg("x"), py::arg("packed"), py::arg("n"),
        py::arg("bias") = py::none(), py::arg("activation") = "none",
        py::call_guard<py::gil_scoped_release>());
  m.def("limit_parallel_regions", &pyserve::limit_parallel_regions, py::arg("threads"));
  m.def("packed_rows", &pyserve::cpu::packed_rows, py::arg("packed"), py::arg("ids"),
        py::call_guard<py::gil_scoped_release>());
  py::class_<pyserve::cpu::PackedLinear>(m, "PackedLinear")
      .def(py::init([](std::vector<std::tuple<at::Tensor, int64_t, int64_t>> parts,
                       std::optional<at::Tensor> bias, int64_t max_rows,
                       std::optional<at::Tensor> gemm_weight) {
             pyserve::cpu::PackedLinear linear{{}, 0, std::move(bias), max_rows, std::move(gemm_weight)};
             for (auto& [packed, rows, part_max_rows] : parts) {
               linear.parts.push_back({packed, rows, part_max_rows});
               linear.out_features += rows;
             }
             TORCH_CHECK(!linear.parts.empty(), "PackedLinear: no packed weight");
             return linear;
           }),
           py::arg("parts"), py::arg("bias"), py::arg("max_rows"), py::arg("gemm_weight"));
  namespace cpu = pyserve::cpu;
  py::enum_<cpu::QkNorm>(m, "QkNorm")
      .value("none", cpu::QkNorm::kNone)
      .value("per_head", cpu::QkNorm::kPerHead)
      .value("per_head_contiguous", cpu::QkNorm::kPerHeadContiguous)
      .value("projection", cpu::QkNorm::kProjection);
  py::class_<cpu::AttentionSpec>(m, "AttentionSpec")
      .def(py::init([](cpu::PackedLinear qkv, cpu::PackedLinear o_proj, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, cpu::QkNorm qk_norm,
                       std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                       std::optional<at::Tensor> cos_sin, double scale, int64_t window, double softcap) {
             return cpu::AttentionSpec{std::move(qkv), std::move(o_proj), num_heads, num_kv_heads, head_dim,
                                       qk_norm, std::move(q_norm), std::move(k_norm), std::move(cos_sin),
                                       scale, window, softcap};
           }),
           py::arg("qkv"), py::arg("o_proj"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("qk_norm"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("cos_sin"), py::arg("scale"), py::arg("window"), py::arg("softcap"));
  py::class_<cpu::DenseMlp>(m, "DenseMlp")
      .def(py::init([](cpu::PackedLinear gate_up, cpu::PackedLinear down, std::string activation) {
             return cpu::DenseMlp{std::move(gate_up), std::move(down), std::move(activation)};
           }),
           py::arg("gate_up"), py::arg("down"), py::arg("activation"));
  py::class_<cpu::MoeMlp>(m, "MoeMlp")
      .def(py::init([](at::Tensor router, int64_t top_k, bool norm_topk_prob,
                       std::vector<at::Tensor> gate_up, at::Tensor down,
                       std::optional<cpu::DenseMlp> shared_expert, std::optional<at::Tensor> shared_gate) {
             return cpu::MoeMlp{std::move(router), top_k, norm_topk_prob, std::move(gate_up),
                                std::move(down), std::move(shared_expert), std::move(shared_gate)};
           }),
           py::arg("router"), py::arg("top_k"), py::arg("norm_topk_prob"), py::arg("gate_up"),
           py::arg("down"), py::arg("shared_expert"), py::arg("shared_gate"));
  py::class_<cpu::LayerSpec>(m, "LayerSpec")
      .def(py::init([](std::string placement, std::vector<at::Tensor> norms, double eps,
                       cpu::AttentionSpec attention, std::optional<cpu::DenseMlp> mlp,
                       std::optional<cpu::MoeMlp> moe) {
             cpu::LayerSpec layer{std::move(placement), std::move(norms), eps, std::move(attention),
                                  std::move(mlp), std::move(moe)};
             cpu::check_layer(layer);
             return layer;
           }),
           py::arg("placement"), py::arg("norms"), py::arg("eps"), py::arg("attention"),
           py::arg("mlp"), py::arg("moe"));
  // one layer's step with buffers of its own (what it returns is new or the caller's)
  m.def("decoder_layer",
        [](const cpu::LayerSpec& layer, const at::Tensor& positions, at::Tensor hidden,
           std::optional<at::Tensor> residual, at::Tensor& key_cache, at::Tensor& value_cache,
           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
           const at::Tensor& query_start_loc, const at::Tensor& seq_lens) {
          cpu::StepBuffers buffers;
          return cpu::decoder_layer_forward(layer, buffers, /*fresh_output=*/true, positions,
                                            std::move(hidden), std::move(residual), key_cache,
                                            value_cache, slot_mapping, block_tables,
                                            query_start_loc, seq_lens);
        },
        py::arg("layer"), py::arg("positions"), py::arg("hidden"), py::arg("residual"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
        py::arg("block_tables"), py::arg("query_start_loc"), py::arg("seq_lens"),
        py::call_guard<py::gil_scoped_release>());
  py::class_<cpu::DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<cpu::LayerSpec>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<int64_t>>(),
           py::arg("layers"), py::arg("key_caches"), py::arg("value_caches"), py::arg("kv_groups"))
      .def("forward", &cpu::DecoderStack::forward, py::arg("positions"), py::arg("hidden"),
           py::arg("residual"), py::arg("slot_mappings"), py::arg("block_tables"),
           py::arg("query_start_loc"), py::arg("seq_lens"), py::call_guard<py::gil_scoped_release>());
  m.def("unpack_linear_weight", &pyserve::cpu::unpack_linear_weight, py::arg("packed"),
        py::arg("n"), py::call_guard<py::gil_scoped_release>());
  m.def("packed_linear", &pyserve::cpu::packed_linear, py::arg("out"), py::arg("x"),
        py::arg("packed"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("packed_in_features", &pyserve::cpu::packed_in_features, py::arg("packed"));
  m.def("grouped_linear", &pyserve::cpu::grouped_linear, py::arg("out"), py::arg("x"),
        py::arg("packed"), py::arg("offsets"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("moe_sort_rows", &pyserve::moe_sort_rows, py::arg("topk_ids"), py::arg("num_experts"),
        py::call_guard<py::gil_scoped_release>());
  m.def("moe_combine", &pyserve::moe_combine, py::arg("out"), py::arg("y"), py::arg("row_of"),
        py::arg("topk_ids"), py::arg("topk_weights"), py::call_guard<py::gil_scoped_release>());
  m.def("fused_moe", &pyserve::cpu::fused_moe, py::arg("out"), py::arg("x"), py::arg("topk_ids"),
        py::arg("topk_weights"), py::arg("gate_up"), py::arg("down"),
        py::arg("gate_up_bias") = py::none(), py::arg("down_bias") = py::none(),
        py::arg("activation") = "silu", py::arg("alpha") = 1.702, py::arg("limit") = 7.0,
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &pyserve::rms_norm, py::arg("out"), py::arg("input"), py::arg("weight"),
        py::arg("epsilon"), py::call_guard<py::gil_scoped_release>());
  m.def("fused_add_rms_norm", &pyserve::fused_add_rms_norm, py::arg("input"), py::arg("residual"),
        py::arg("weight"), py::arg("epsilon"), py::call_guard<py::gil_scoped_release>());
  m.def("rotary_embedding", &pyserve::rotary_embedding, py::arg("positions"), py::arg("query"),
        py::arg("key"), py::arg("head_size"), py::arg("cos_sin_cache"), py::arg("is_neox"),
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &pyserve::silu_and_mul, py::arg("out"), py::arg("input"),
        py::call_guard<py::gil_scoped_release>());
  m.def("sample_tokens", &pyserve::cpu::sample_tokens, py::arg("out"), py::arg("logits"),
        py::arg("greedy"), py::arg("temperature") = py::none(), py::arg("top_k") = py::none(),
        py::arg("top_p") = py::none(), py::arg("min_p") = py::none(), py::arg("uniforms") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("apply_penalties", &pyserve::cpu::apply_penalties, py::arg("logits"), py::arg("presence"),
        py::arg("frequency"), py::arg("repetition"), py::arg("seen_ids"), py::arg("seen_offsets"),
        py::arg("output_ids"), py::arg("output_offsets"), py::call_guard<py::gil_scoped_release>());
  m.def("logprob_columns", &pyserve::cpu::logprob_columns, py::arg("logits"), py::arg("targets"),
        py::arg("k"), py::call_guard<py::gil_scoped_release>());
  m.def("apply_token_bitmask", &pyserve::cpu::apply_token_bitmask, py::arg("logits"),
        py::arg("bitmask"), py::arg("rows"), py::call_guard<py::gil_scoped_release>());
  m.def("built_with_cuda", &pyserve::built_with_cuda);
  // an int64 array (the scheduler's TokenHistory) read in place, without a copy
  m.def("ngram_match",
        [](py::array_t<int64_t, py::array::c_style | py::array::forcecast> tokens, int64_t min_n,
           int64_t max_n, int64_t window) {
          if (tokens.ndim() != 1) throw std::invalid_argument("ngram_match: tokens must be 1-D");
          return pyserve::cpu::ngram_match(tokens.data(), tokens.shape(0), min_n, max_n, window);
        },
        py::arg("tokens"), py::arg("min_n"), py::arg("max_n"), py::arg("window"));

  // Collectives wait for the other ranks: they release the GIL so the rest of the process
  // (the event loop, a watchdog) keeps running meanwhile.
  using pyserve::ShmCommunicator;
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<ShmCommunicator>(m, "ShmCommunicator")
      .def(py::init<const std::string&, int64_t, int64_t, int64_t, bool>(), py::arg("name"),
           py::arg("rank"), py::arg("world_size"), py::arg("slot_bytes"), py::arg("create"))
      .def("all_reduce", &ShmCommunicator::all_reduce, py::arg("tensor"), release())
      .def("all_gather", &ShmCommunicator::all_gather, py::arg("tensor"), release())
      .def("gather", &ShmCommunicator::gather, py::arg("tensor"), py::arg("root") = 0, release())
      .def("broadcast", &ShmCommunicator::broadcast, py::arg("tensor"), py::arg("root") = 0, release())
      .def("broadcast_tensors", &ShmCommunicator::broadcast_tensors, py::arg("tensors"),
           py::arg("root") = 0, release())
      .def("barrier", &ShmCommunicator::barrier, release())
      .def("abort", &ShmCommunicator::abort)
      .def("unlink", &ShmCommunicator::unlink)
      .def_property_readonly("aborted", &ShmCommunicator::aborted)
      .def_property_readonly("rank", &ShmCommunicator::rank)
      .def_property_readonly("world_size", &ShmCommunicator::world_size)
      .def_property_readonly("name", &ShmCommunicator::name);

#ifdef PYSERVE_CUDA
  // capture() calls back into Python (the forward to record) with the GIL held throughout.
  py::class_<pyserve::cuda::CudaGraphs>(m, "CudaGraphs")
      .def(py::init<int64_t>(), py::arg("device"))
      .def("capture", [](pyserve::cuda::CudaGraphs& g, int64_t size, py::function forward) {
             g.capture(size, [&forward] { forward(); });
           }, py::arg("size"), py::arg("forward"))
      .def("replay", &pyserve::cuda::CudaGraphs::replay, py::arg("size"), release())
      .def("has", &pyserve::cuda::CudaGraphs::has, py::arg("size"))
      .def("sizes", &pyserve::cuda::CudaGraphs::sizes)
      .def("reset", &pyserve::cuda::CudaGraphs::reset);
  m.def("notify_when_done", &pyserve::cuda::notify_when_done, py::arg("eventfd"), py::arg("device"));
#endif
#ifdef PYSERVE_NCCL
  using pyserve::cuda::NcclCommunicator;
  m.def("nccl_unique_id", [] { return py::bytes(pyserve::cuda::nccl_unique_id()); });
  py::class_<NcclCommunicator>(m, "NcclCommunicator")
      .def(py::init<const std::string&, int64_t, int64_t>(), py::arg("unique_id"), py::arg("rank"),
           py::arg("world_size"), release())
      .def("all_reduce", &NcclCommunicator::all_reduce, py::arg("tensor"), release())
      .def("all_gather", &NcclCommunicator::all_gather, py::arg("tensor"), release())
      .def("gather", &NcclCommunicator::gather, py::arg("tensor"), py::arg("root") = 0, release())
      .def("broadcast", &NcclCommunicator::broadcast, py::arg("tensor"), py::arg("root") = 0, release())
      .def("abort", &NcclCommunicator::abort)
      .def_property_readonly("rank", &NcclCommunicator::rank)
      .def_property_readonly("world_size", &NcclCommunicator::world_size);
#endif
  m.def("built_with_nccl", [] {
#ifdef PYSERVE_NCCL
    return true;
#else
    return false;
#endif
  });
}
