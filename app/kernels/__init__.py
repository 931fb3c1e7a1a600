"""The native kernels (native/), behind wrappers that check their inputs (ops.py)."""

from app.kernels.ops import (
    DecoderStack,
    add_rms_norm,
    bf16_dot,
    bf16_dot_ratio,
    bind_threads,
    compiled_isas,
    convert_quant,
    dequantize,
    describe,
    int_mul_ratio,
    isa,
    kv_cache_blocks,
    kv_cache_from_blocks,
    linear_f32_out,
    paged_attention,
    pack_quant,
    packed_linear,
    packed_rows,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    supported_isas,
    use_bf16_dot,
    use_int_tiles,
    use_isa,
    wide_int_tiles,
    widens_prompts,
    write_kv_cache,
)

__all__ = [
    "DecoderStack", "add_rms_norm", "bf16_dot", "bf16_dot_ratio", "bind_threads", "compiled_isas", "convert_quant",
    "dequantize", "describe", "int_mul_ratio", "isa", "kv_cache_blocks", "kv_cache_from_blocks", "linear_f32_out", "pack_quant", "packed_linear", "packed_rows",
    "paged_attention", "rms_norm", "rotary_embedding",
    "silu_and_mul", "supported_isas", "use_bf16_dot", "use_int_tiles", "use_isa", "wide_int_tiles", "widens_prompts", "write_kv_cache",
]
