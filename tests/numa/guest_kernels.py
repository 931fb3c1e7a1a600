"""Every native kernel, float32 and bfloat16, under every ISA this CPU runs: no torch, raw buffers.

    python tests/numa/guest_kernels.py   # prints one JSON line: {isa: {kernel/dtype: [sum, sum of |x|]}}

Runs on the host and inside the NUMA guest (whose emulated CPUs have AVX2 but no AVX-512, or with
`--cpu Westmere` no AVX at all): importing torch there takes a minute, the extension alone a second.
A kernel compiled for an ISA the CPU lacks dies with SIGILL here; test_numa_vm.py compares the sums.
"""

from __future__ import annotations

import array
import json
import math
import random
import struct

import app._native as native

F32, BF16, I32, I64, U8 = 0, 1, 2, 3, 4
T, K, HQ, HK, D, BLOCK, BLOCKS, I, V = 5, 72, 4, 2, 64, 16, 6, 40, 24  # odd sizes: vector tails run too


class Buffer:
    """A contiguous array with the (pointer, dtype code, shape, strides) tuple the extension takes."""

    def __init__(self, code: int, shape: list[int], values: list[float] | None = None):
        n = math.prod(shape)
        self.code, self.shape = code, shape
        if code == BF16:
            self.data = array.array("H", [_to_bf16(v) for v in values] if values else [0] * n)
        else:
            self.data = array.array({F32: "f", I32: "i", I64: "q", U8: "B"}[code], values if values else [0] * n)

    @property
    def ref(self):
        strides = [math.prod(self.shape[i + 1:]) for i in range(len(self.shape))]
        return self.data.buffer_info()[0], self.code, self.shape, strides

    def floats(self) -> list[float]:
        if self.code == BF16:
            return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in self.data]
        return list(self.data)


def _to_bf16(value: float) -> int:
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF  # round to nearest even


def _random(rng: random.Random, n: int, scale: float = 1.0) -> list[float]:
    return [rng.uniform(-scale, scale) for _ in range(n)]


def run_all(code: int) -> dict[str, list[float]]:
    rng = random.Random(7)
    out: dict[str, list[float]] = {}

    x, w = Buffer(code, [T, K], _random(rng, T * K)), Buffer(code, [K], _random(rng, K, 0.5))
    normed = Buffer(code, [T, K])
    native.rms_norm(normed.ref, x.ref, w.ref, 1e-5)
    out["rms_norm"] = normed.floats()
    residual = Buffer(code, [T, K], _random(rng, T * K))
    native.add_rms_norm(x.ref, residual.ref, w.ref, 1e-5)
    out["add_rms_norm"] = x.floats() + residual.floats()

    positions = Buffer(I64, [T], [3, 0, 9, 17, 30])
    q, k = Buffer(code, [T, HQ, D], _random(rng, T * HQ * D)), Buffer(code, [T, HK, D], _random(rng, T * HK * D))
    angles = [p / 10000 ** (2 * i / D) for p in range(32) for i in range(D // 2)]
    cos_sin = Buffer(F32, [32, D], [v for p in range(32) for v in
                                    [math.cos(a) for a in angles[p * D // 2:(p + 1) * D // 2]] +
                                    [math.sin(a) for a in angles[p * D // 2:(p + 1) * D // 2]]])
    native.rotary_embedding(positions.ref, q.ref, k.ref, cos_sin.ref)
    out["rotary_embedding"] = q.floats() + k.floats()

    gate_up, act = Buffer(code, [T, 2 * I], _random(rng, T * 2 * I, 3.0)), Buffer(code, [T, I])
    native.silu_and_mul(act.ref, gate_up.ref)
    out["silu_and_mul"] = act.floats()

    # keys are transposed within a block ([blocks, kv_heads, head_dim, block_size]); values are not
    key_cache, value_cache = Buffer(code, [BLOCKS, HK, D, BLOCK]), Buffer(code, [BLOCKS, HK, BLOCK, D])
    context = 2 * BLOCK + 3  # two sequences: 35 tokens (3 blocks) and T new tokens after 30 cached
    for start, count in ((0, context), (3 * BLOCK, 30 + T)):
        keys = Buffer(code, [count, HK, D], _random(rng, count * HK * D))
        values = Buffer(code, [count, HK, D], _random(rng, count * HK * D))
        slots = Buffer(I64, [count], list(range(start, start + count)))
        native.write_kv_cache(keys.ref, values.ref, key_cache.ref, value_cache.ref, slots.ref)
    out["write_kv_cache"] = key_cache.floats() + value_cache.floats()
    query = Buffer(code, [1 + T, HQ, D], _random(rng, (1 + T) * HQ * D))
    attended = Buffer(code, [1 + T, HQ, D])
    # every buffer is held in a name while the kernel runs: `.ref` is a bare pointer into it
    tables, lens, starts = Buffer(I32, [2, 3], [0, 1, 2, 3, 4, 5]), Buffer(I32, [2], [context, 30 + T]), \
        Buffer(I64, [3], [0, 1, 1 + T])
    native.paged_attention(attended.ref, query.ref, key_cache.ref, value_cache.ref, tables.ref, lens.ref, starts.ref,
                           D ** -0.5)
    out["paged_attention"] = attended.floats()

    weight, logits, rows = Buffer(code, [V, K], _random(rng, V * K)), Buffer(F32, [T, V]), Buffer(code, [T, K], _random(rng, T * K))
    native.linear_f32_out(logits.ref, rows.ref, weight.ref)
    out["linear_f32_out"] = logits.floats()

    # kept-quantized weights (GGUF Q4_1 and Q8_0 rows of 32-weight blocks) and bfloat16 ones, repacked, under
    # each activation mode (BF16 weights ignore it)
    QK = 96  # three blocks a row; V = 24 rows: one full 16-row panel and a tail
    for qtype, block in ((3, lambda: struct.pack("<ee", rng.uniform(0.01, 0.1), rng.uniform(-0.5, 0.5)) +
                          bytes(rng.randrange(256) for _ in range(16))),
                         (8, lambda: struct.pack("<e", rng.uniform(0.001, 0.02)) +
                          bytes(rng.randrange(256) for _ in range(32))),
                         (30, lambda: struct.pack("<32H", *(_to_bf16(rng.uniform(-0.1, 0.1)) for _ in range(32))))):
        raw = b"".join(block() for _ in range(V * QK // 32))
        gguf = Buffer(U8, [V, len(raw) // V], list(raw))
        packed = Buffer(U8, [native.packed_bytes(qtype, V, QK)])
        native.pack_quant(packed.ref, gguf.ref, qtype, QK)
        rows = Buffer(code, [T, QK], _random(rng, T * QK))
        for activations, prompt in ((0, False), (1, False), (2, False), (2, True)):  # int16 prompt rows: widened on AVX2
            result = Buffer(code, [T, V])
            native.packed_linear(result.ref, rows.ref, packed.ref, qtype, QK, V, activations, prompt)
            out[f"packed_linear/{qtype}/{activations}{'/prompt' if prompt else ''}"] = result.floats()
    return {name: [sum(values), sum(abs(v) for v in values)] for name, values in out.items()}


def main() -> None:
    compiled = native.compiled_isas()
    supported = compiled[compiled.index(native.best_isa()):]
    report = {}
    for isa in supported:
        native.select_isa(isa)
        report[isa] = {f"{name}/{dtype}": sums for dtype, code in (("float32", F32), ("bfloat16", BF16))
                       for name, sums in run_all(code).items()}
    print(json.dumps({"best": native.best_isa(), "sums": report}))


if __name__ == "__main__":
    main()
