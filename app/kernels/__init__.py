"""The native kernels (native/), behind wrappers that check their inputs (ops.py)."""

from app.kernels.ops import (
    add_rms_norm,
    bind_threads,
    compiled_isas,
    dequantize,
    isa,
    linear_f32_out,
    paged_attention,
    quant_linear,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    supported_isas,
    use_isa,
    write_kv_cache,
)

__all__ = [
    "add_rms_norm", "bind_threads", "compiled_isas", "dequantize", "isa", "linear_f32_out", "paged_attention", "quant_linear", "rms_norm", "rotary_embedding",
    "silu_and_mul", "supported_isas", "use_isa", "write_kv_cache",
]
