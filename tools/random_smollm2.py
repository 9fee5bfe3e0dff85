"""A SmolLM2-135M-shaped model with random weights, as a Hugging Face folder: for timing where the real
weights cannot travel (a pass costs the same whatever the weights' values). The tokenizer is the bundled
GGUF's (SmolLM2's own), as its conversion writes it.

    python tools/random_smollm2.py OUT_FOLDER
"""

import shutil
import sys
from pathlib import Path

import torch
import transformers

from speculant.models.gguf import convert_gguf
from speculant.models.loader import default_model_path

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                    rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                    bos_token_id=1, eos_token_id=2, initializer_range=0.02)

out = Path(sys.argv[1])
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2_135M))
model.save_pretrained(out)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(convert_gguf(default_model_path())[0] / name, out / name)
print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
