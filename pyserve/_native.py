"""The one module that imports the native extension."""

try:
    from pyserve import _C
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "pyserve's native extension pyserve._C is not built. Run the set-up in README.md "
        "(or `pip install --no-build-isolation -e .` in an environment with torch)."
    ) from exc

BlockPool = _C.BlockPool
reshape_and_cache = _C.reshape_and_cache
paged_attention = _C.paged_attention
built_with_cuda = _C.built_with_cuda
built_with_nccl = _C.built_with_nccl
ShmCommunicator = _C.ShmCommunicator
NcclCommunicator = getattr(_C, "NcclCommunicator", None)  # CUDA builds with NCCL only
nccl_unique_id = getattr(_C, "nccl_unique_id", None)
CudaGraphs = getattr(_C, "CudaGraphs", None)  # CUDA builds only
notify_when_done = getattr(_C, "notify_when_done", None)  # CUDA builds only
pack_linear_weight = _C.pack_linear_weight
packed_linear = _C.packed_linear
packed_in_features = _C.packed_in_features
grouped_linear = _C.grouped_linear
fused_moe = _C.fused_moe
moe_sort_rows = _C.moe_sort_rows
moe_combine = _C.moe_combine
unpack_linear_weight = _C.unpack_linear_weight
pack_gguf_weight = _C.pack_gguf_weight
packed_rows = _C.packed_rows
int8_dot_supported = _C.int8_dot_supported
encoder_attention_supported = _C.encoder_attention_supported
encoder_attention = _C.encoder_attention
bf16x3_supported = _C.bf16x3_supported
pack_bf16x3_weight = _C.pack_bf16x3_weight
bf16x3_linear = _C.bf16x3_linear
limit_parallel_regions = _C.limit_parallel_regions
# the decoder layers as layer specs run by one native stack (csrc/cpu/decoder_layer.h)
QkNorm = _C.QkNorm
AttentionSpec = _C.AttentionSpec
DenseMlp = _C.DenseMlp
MoeMlp = _C.MoeMlp
LayerSpec = _C.LayerSpec
DecoderStack = _C.DecoderStack
decoder_layer = _C.decoder_layer
PackedLinear = _C.PackedLinear
rms_norm = _C.rms_norm
fused_add_rms_norm = _C.fused_add_rms_norm
rotary_embedding = _C.rotary_embedding
silu_and_mul = _C.silu_and_mul
apply_token_bitmask = _C.apply_token_bitmask  # CPU only (CUDA: xgrammar's torch op)
sample_tokens = _C.sample_tokens  # CPU only (CUDA: the sampler's torch ops)
apply_penalties = _C.apply_penalties  # CPU only
logprob_columns = _C.logprob_columns  # CPU only
ngram_match = _C.ngram_match
