"""Small GGUF files written in the tests: the metadata every Llama-family file needs, then the tensors."""

from __future__ import annotations

from pathlib import Path


def new_gguf(path: Path, arch: str, *, layers: int, hidden: int, inter: int, heads: int, kv_heads: int, vocab: int,
             rms_eps: float = 1e-5, rope_base: float = 10000.0, context: int = 512, tokenizer_of: Path | None = None):
    """A GGUFWriter with the model metadata and a vocabulary; add tensors, then `write_gguf`.

    The vocabulary is a placeholder (no merges: ids only) unless `tokenizer_of` names a GGUF file whose
    tokenizer (tokens, merges, special ids, chat template) is copied, so the model can be served over HTTP."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
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
                      kv_heads: int, vocab: int, qkv_bias: bool = False, **metadata) -> None:
    """A whole Llama-family model of random float32 weights (with Qwen2's QKV biases if `qkv_bias`);
    `metadata` goes to `new_gguf` (rms_eps, rope_base, tokenizer_of...)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    w = new_gguf(path, arch, layers=layers, hidden=hidden, inter=inter, heads=heads, kv_heads=kv_heads, vocab=vocab,
                 **metadata)

    def add(name: str, *shape: int, scale: float = 0.05, offset: float = 0.0) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale + offset).astype(np.float32))

    d = hidden // heads
    add("token_embd.weight", vocab, hidden, scale=0.5)
    add("output.weight", vocab, hidden)
    add("output_norm.weight", hidden, offset=1.0)
    for i in range(layers):
        for name, rows in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d)):
            add(f"blk.{i}.attn_{name}.weight", rows, hidden)
            if qkv_bias:
                add(f"blk.{i}.attn_{name}.bias", rows, scale=0.5)
        add(f"blk.{i}.attn_output.weight", hidden, heads * d)
        add(f"blk.{i}.ffn_gate.weight", inter, hidden)
        add(f"blk.{i}.ffn_up.weight", inter, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, inter)
        add(f"blk.{i}.attn_norm.weight", hidden, offset=1.0)
        add(f"blk.{i}.ffn_norm.weight", hidden, offset=1.0)
    write_gguf(w)
