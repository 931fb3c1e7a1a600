"""Small GGUF files written in the tests: the metadata every Llama-family file needs, then the tensors."""

from __future__ import annotations

from pathlib import Path


def new_gguf(path: Path, arch: str, *, layers: int, hidden: int, inter: int, heads: int, kv_heads: int, vocab: int,
             rms_eps: float = 1e-5, rope_base: float = 10000.0, context: int = 512, tokenizer_of: Path | None = None,
             model_name: str | None = None):
    """A GGUFWriter with the model metadata and a vocabulary; add tensors, then `write_gguf`.

    The vocabulary is a placeholder (no merges: ids only) unless `tokenizer_of` names a GGUF file whose
    tokenizer (tokens, merges, special ids, chat template) is copied, so the model can be served over HTTP."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    if model_name is not None:
        w.add_name(model_name)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_freq_base(rope_base)
    w.add_vocab_size(vocab)
    if tokenizer_of is None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(vocab)])
        return w
    for key, field in gguf.GGUFReader(str(tokenizer_of)).fields.items():
        if key.startswith("tokenizer."):
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), value_type, sub_type)
    return w


def write_gguf(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_random_gguf(path: Path, arch: str, *, seed: int, layers: int, hidden: int, inter: int, heads: int,
                      kv_heads: int, vocab: int, qkv_bias: bool = False, experts: int = 0, experts_used: int = 2,
                      expert_inter: int = 0, expert_type: str = "F32", weight_type: str = "F32",
                      head_dim: int | None = None, **metadata) -> None:
    """A whole Llama-family model of random float32 weights (with Qwen2's QKV biases if `qkv_bias`, Qwen3's
    Q/K norms for qwen3 and qwen3moe); with `experts`, a mixture of them in every layer (each of
    `expert_inter` features, weights of `expert_type`: F32, a type gguf quantizes, or a K-quant) in place of
    the MLP; `weight_type`: the attention's and MLP's weights' type (as `expert_type`); `head_dim`: heads of another
    size than hidden / heads (as Qwen3's); `metadata` goes to `new_gguf` (rms_eps, rope_base, tokenizer_of...)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    w = new_gguf(path, arch, layers=layers, hidden=hidden, inter=inter, heads=heads, kv_heads=kv_heads, vocab=vocab,
                 **metadata)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(experts_used)
        w.add_expert_feed_forward_length(expert_inter)

    def add(name: str, *shape: int, scale: float = 0.05, offset: float = 0.0, kind: str = "F32") -> None:
        values = (rng.standard_normal(shape) * scale + offset).astype(np.float32)
        if kind == "F32":
            w.add_tensor(name, values)
            return
        qtype = gguf.GGMLQuantizationType[kind]
        flat = values.reshape(-1, shape[-1])
        blocks = quantize_k(flat, kind) if kind.endswith("_K") or kind.startswith("IQ4") \
            else gguf.quants.quantize(flat, qtype)
        w.add_tensor(name, blocks.reshape(*shape[:-1], -1), raw_dtype=qtype)

    d = head_dim or hidden // heads
    add("token_embd.weight", vocab, hidden, scale=0.5)
    add("output.weight", vocab, hidden)
    add("output_norm.weight", hidden, offset=1.0)
    for i in range(layers):
        for name, rows in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d)):
            add(f"blk.{i}.attn_{name}.weight", rows, hidden, kind=weight_type)
            if qkv_bias:
                add(f"blk.{i}.attn_{name}.bias", rows, scale=0.5)
        add(f"blk.{i}.attn_output.weight", hidden, heads * d, kind=weight_type)
        if arch in ("qwen3", "qwen3moe"):
            add(f"blk.{i}.attn_q_norm.weight", d, offset=1.0)
            add(f"blk.{i}.attn_k_norm.weight", d, offset=1.0)
        if experts:
            add(f"blk.{i}.ffn_gate_inp.weight", experts, hidden, scale=0.5)
            add(f"blk.{i}.ffn_gate_exps.weight", experts, expert_inter, hidden, kind=expert_type)
            add(f"blk.{i}.ffn_up_exps.weight", experts, expert_inter, hidden, kind=expert_type)
            add(f"blk.{i}.ffn_down_exps.weight", experts, hidden, expert_inter, kind=expert_type)
        else:
            add(f"blk.{i}.ffn_gate.weight", inter, hidden, kind=weight_type)
            add(f"blk.{i}.ffn_up.weight", inter, hidden, kind=weight_type)
            add(f"blk.{i}.ffn_down.weight", hidden, inter, kind=weight_type)
        add(f"blk.{i}.attn_norm.weight", hidden, offset=1.0)
        add(f"blk.{i}.ffn_norm.weight", hidden, offset=1.0)
    write_gguf(w)


def quantize_k(values, kind: str):
    """float32 [rows, cols] (cols a multiple of 256; of 32 for IQ4_NL) as GGUF blocks of `kind` (Q3_K to Q6_K,
    IQ4_NL, IQ4_XS), uint8 [rows, bytes]: plain rounding against each sub-block's range, not llama.cpp's
    search for the best scales (the gguf package cannot quantize these). Its dequantization is the reference
    the tests compare with."""
    import numpy as np

    rows, cols = values.shape
    if kind in ("IQ4_NL", "IQ4_XS"):
        return _quantize_iq4(values.astype(np.float32), kind)
    x = values.astype(np.float32).reshape(-1, 256)
    n = x.shape[0]

    def half(v):  # float16 bytes [n, 2], and the value they hold
        h = v.astype(np.float16)
        return h.reshape(n, 1).view(np.uint8), h.astype(np.float32)

    def safe(v):
        return np.where(v > 0, v, 1)

    if kind == "Q6_K":  # w = d sc (q - 32): an int8 scale per 16 weights, q 6 bits
        sub = x.reshape(n, 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d_bytes, d = half(scale.max(-1) / 127)
        sc = np.clip(np.round(scale / safe(d)[:, None]), 0, 127).astype(np.int8)
        q = (np.clip(np.round(sub / safe(d[:, None] * sc)[..., None]), -32, 31) + 32).astype(np.uint8)
        qt = q.reshape(n, 2, 4, 32)  # [block, half of 128, t, l]: weight 128 half + 32 t + l
        ql = np.concatenate([(qt[:, :, 0] & 15) | ((qt[:, :, 2] & 15) << 4),
                             (qt[:, :, 1] & 15) | ((qt[:, :, 3] & 15) << 4)], axis=-1).reshape(n, 128)
        qh = ((qt[:, :, 0] >> 4) | ((qt[:, :, 1] >> 4) << 2) | ((qt[:, :, 2] >> 4) << 4)
              | ((qt[:, :, 3] >> 4) << 6)).reshape(n, 64)
        blocks = np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=-1)
        return blocks.reshape(rows, -1)
    if kind == "Q3_K":  # w = d (c - 32) q: a 6-bit scale code c per 16 weights, q in -4..3
        sub = x.reshape(n, 16, 16)
        peak = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
        scale = -peak / 4  # signed, so that the largest magnitude takes q = -4
        d_bytes, d = half(np.abs(scale).max(-1) / 31)
        sc = np.clip(np.round(scale / safe(d)[:, None]), -31, 31).astype(np.int8)
        step = d[:, None] * sc
        q = np.clip(np.round(sub / np.where(step != 0, step, 1)[..., None]), -4, 3).astype(np.int8)
        u = (q + 4).astype(np.uint8).reshape(n, 2, 4, 32)  # [block, half of 128, t, l]: weight 128 half + 32 t + l
        qs = sum((u[:, :, t] & 3) << (2 * t) for t in range(4)).astype(np.uint8).reshape(n, 64)
        hmask = sum(((u[:, h, t] >> 2) & 1) << (4 * h + t) for h in range(2) for t in range(4)).astype(np.uint8)
        # code c: low nibble in byte c % 8 (c < 8 the low one, else the high), top bits in byte 8 + c % 4
        code = (sc + 32).astype(np.uint8)
        low = (code[:, :8] & 15) | ((code[:, 8:] & 15) << 4)
        high = sum(((code[:, 4 * i:4 * i + 4] >> 4) & 3) << (2 * i) for i in range(4)).astype(np.uint8)
        return np.concatenate([hmask, qs, low, high, d_bytes], axis=-1).reshape(rows, -1)
    top = {"Q4_K": 15, "Q5_K": 31}[kind]  # w = d sc q - dmin m: 6-bit scale and min per 32 weights
    sub = x.reshape(n, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - low) / top
    d_bytes, d = half(scale.max(-1) / 63)
    dmin_bytes, dmin = half((-low).max(-1) / 63)
    sc = np.clip(np.round(scale / safe(d)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / safe(dmin)[:, None]), 0, 63).astype(np.uint8)
    q = np.clip(np.round((sub + (dmin[:, None] * m)[..., None]) / safe(d[:, None] * sc)[..., None]), 0, top)
    q = q.astype(np.uint8)
    scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=-1)
    nibbles = (q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)  # chunk c: sub-block 2c low, 2c + 1 high
    parts = [d_bytes, dmin_bytes, scales]
    if kind == "Q5_K":
        parts.append(sum(((q[:, s] >> 4) & 1) << s for s in range(8)).astype(np.uint8))  # bit s: sub-block s
    parts.append(nibbles.reshape(n, 128))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # GGML's codebook


def _quantize_iq4(values, kind: str):
    """IQ4_NL (per 32: fp16 d, 16 bytes of 4-bit codebook indices) or IQ4_XS (per 256: fp16 d, a 6-bit scale
    code per 32, the indices): each block's largest magnitude on the codebook's -127, the rest to the nearest."""
    import numpy as np

    rows, cols = values.shape
    book = np.array(IQ4_VALUES, dtype=np.float32)
    blocks = values.reshape(-1, 32)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[:, None], -1)[:, 0]
    scale = -peak / 127  # each block's ideal d
    if kind == "IQ4_NL":
        d = scale.astype(np.float16)
        step = d.astype(np.float32)
    else:
        per = scale.reshape(-1, 8)
        top = np.abs(per).max(-1) / 31
        d = top.astype(np.float16)
        dd = d.astype(np.float32)
        code = np.clip(np.round(per / np.where(dd > 0, dd, 1)[:, None]), -31, 31).astype(np.int8)
        step = (dd[:, None] * code).reshape(-1)
    q = np.abs(blocks[..., None] / np.where(step != 0, step, 1)[:, None, None] - book).argmin(-1).astype(np.uint8)
    nibbles = (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)  # byte i: weight i (low), i + 16 (high)
    if kind == "IQ4_NL":
        return np.concatenate([d.reshape(-1, 1).view(np.uint8), nibbles], axis=-1).reshape(rows, -1)
    u = (code.astype(np.int16) + 32).astype(np.uint8)  # [superblocks, 8]
    high = sum(((u[:, b].astype(np.uint16) >> 4) & 3) << (2 * b) for b in range(8)).astype(np.uint16)
    low = (u[:, 0::2] & 15) | ((u[:, 1::2] & 15) << 4)
    parts = [d.reshape(-1, 1).view(np.uint8), high.reshape(-1, 1).view(np.uint8), low, nibbles.reshape(-1, 128)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def requantize_gguf(source: Path, path: Path, kind_of) -> None:
    """`source`'s model written to `path` with each 2-D tensor in the type `kind_of(name, columns)` says (a
    K-quant, an IQ4 type, or a type gguf can quantize); 1-D tensors stay float32. Every metadata field is copied."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(source))
    w = gguf.GGUFWriter(str(path), str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), value_type, sub_type)
    for tensor in reader.tensors:
        values = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if values.ndim == 1:
            w.add_tensor(tensor.name, values)
            continue
        kind = kind_of(tensor.name, values.shape[1])
        qtype = gguf.GGMLQuantizationType[kind]
        ours = kind.endswith("_K") or kind.startswith("IQ4")
        blocks = quantize_k(values, kind) if ours else gguf.quants.quantize(values, qtype)
        w.add_tensor(tensor.name, blocks, raw_dtype=qtype)
    write_gguf(w)


def copy_gguf(source: Path, path: Path, metadata: dict) -> None:
    """`source` written to `path` as it is (its tensors' bytes, its metadata), with the `metadata` keys added or
    replaced (ints as uint32, as llama.cpp writes token ids, negative ones as int32; floats as float32)."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    w = gguf.GGUFWriter(str(path), str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in metadata:
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), value_type, sub_type)
    for key, value in metadata.items():
        kind = (gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.STRING
                if isinstance(value, str) else gguf.GGUFValueType.UINT32 if value >= 0 else gguf.GGUFValueType.INT32)
        w.add_key_value(key, value, kind)
    for tensor in reader.tensors:
        w.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    write_gguf(w)
