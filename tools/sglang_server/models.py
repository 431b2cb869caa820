"""Model folders for a real SGLang server without a download: a config, a locally trained tokenizer, no weights.

SGLang serves them with ``--load-format dummy``; the harness plugin (``harness_plugin.py``) gives the
dummy weights a scale at which the output depends on the prompt (``weights.py``). Three shapes:

* ``mla-tiny``: DeepSeek-V3 (``DeepseekV3ForCausalLM``), 4 dense layers of MLA rows of 1152 B in bf16
  (kv_lora_rank 512 + qk_rope_head_dim 64), hidden size 256: for correctness;
* ``mla-kv``: the same rows in 61 layers, as DeepSeek-V3 has, with the small hidden size: a host hit
  moves as many bytes per token as a real DeepSeek-V3 (70,272 B), for timing;
* ``mha-tiny``: Llama (``LlamaForCausalLM``), 4 layers, 2 KV heads of 128 (512-B K and V rows): the MHA
  host pool (from SGLang 0.5.22, Granite with Llama's arithmetic: see GRANITE_FROM);
* ``mla-dsa``: DeepSeek-V3.2 (``DeepseekV32ForCausalLM``, with the indexer), 4 layers: the only models
  whose host pools SGLang layer-shards (two ranks, issue 28).

Real-size shapes, for timing what a user feels (TTFT and TPOT, issue 36): the compute per token of a
real model, so a host hit's load competes with real kernels.

* ``mha-8b``: Llama-3.1-8B's shape: 32 layers, hidden 4096, 32 query heads, 8 KV heads of 128,
  intermediate 14336 (128 KiB of KV per token; 16 GB of bf16 weights);
* ``mla-v2lite``: DeepSeek-V2-Lite's shape in SGLang's DeepSeek model class: 27 layers, hidden 2048,
  16 heads, no q LoRA, kv_lora_rank 512 + rope 64 (1152-B rows, 31 KB per token), the first layer
  dense and 26 MoE layers of 64 routed experts (6 per token) and 2 shared ones of 1408;
* ``mla-v2lite-dense``: the same attention with every layer dense (intermediate 10944, about the
  MoE layers' active compute): the fallback where the MoE kernels do not run.

Every shape keeps the 2048-id tokenizer, so the real models' vocabularies (128K and 102K ids) are
not modelled: their LM head is about 3-6% of a real step's compute.

transformers 5 does not write ``moe_layer_freq``, and SGLang 0.5.17 reads it when it builds a DeepSeek
layer, so the config carries it, with ``scoring_func`` and ``topk_method``. Every layer is dense
(``first_k_dense_replace`` = the layer count), so no MoE kernel runs.

    python3 tools/sglang_server/models.py mla-tiny /tmp/models/mla-tiny
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 2048
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0-3
BOS, EOS = 1, 2
CONTEXT = 40960  # room for the 32K-token prefixes of the TTFT runs

_DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 4,
    "kv_lora_rank": 512, "q_lora_rank": 64, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "moe_layer_freq": 1, "ep_size": 1, "num_nextn_predict_layers": 0,
    "rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
}
_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 128, "rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
}
# DeepSeek-V3.2 (DSA): MLA plus the indexer; SGLang builds layer-sharded host pools only for such models.
_DSA = dict(_DEEPSEEK, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", index_topk=2048,
            index_n_heads=64, index_head_dim=128)
_LLAMA_8B = dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 rope_theta=500000.0, rms_norm_eps=1e-5)
_V2_LITE = dict(_DEEPSEEK, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, n_shared_experts=2,
                n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1)
_V2_LITE_DENSE = dict(_V2_LITE)
del _V2_LITE_DENSE["first_k_dense_replace"]  # every layer dense (config() sets it to the layer count)
SHAPES = {"mla-tiny": (_DEEPSEEK, 4), "mla-kv": (_DEEPSEEK, 61), "mha-tiny": (_LLAMA, 4), "mla-dsa": (_DSA, 4),
          "mha-8b": (_LLAMA_8B, 32), "mla-v2lite": (_V2_LITE, 27), "mla-v2lite-dense": (_V2_LITE_DENSE, 27)}
REAL_SIZE = ("mha-8b", "mla-v2lite", "mla-v2lite-dense")


# From 0.5.22 SGLang's Llama (and Qwen2) MLP builds a CuTe-DSL dual GEMM on CUDA and imports ``cutlass``
# (nvidia-cutlass-dsl: a 92 MB wheel, more than a device call carries), so the engine dies at model build,
# with the plugin off too. Granite is Llama with four multipliers; set to Llama's values (attention scaled by
# head_dim ** -0.5, the others 1) it computes the same, and SGLang's Granite class imports no CuTe DSL.
GRANITE_FROM = (0, 5, 22)


def _release(release: str | None) -> tuple:
    try:
        return tuple(int(part) for part in str(release).split(".")[:3])
    except ValueError:  # a label such as 0.5.10.post1 keeps its first three numbers; None is no release
        return ()


def config(kind: str, release: str | None = None) -> dict:
    base, layers = SHAPES[kind]
    cfg = dict(base, num_hidden_layers=layers, vocab_size=VOCAB, max_position_embeddings=CONTEXT,
               bos_token_id=BOS, eos_token_id=EOS, pad_token_id=3, tie_word_embeddings=False,
               torch_dtype="bfloat16", use_cache=True)
    if cfg["model_type"] == "llama" and _release(release) >= GRANITE_FROM:
        cfg.update(architectures=["GraniteForCausalLM"], model_type="granite",
                   attention_multiplier=cfg["head_dim"] ** -0.5, embedding_multiplier=1.0, residual_multiplier=1.0,
                   logits_scaling=1.0)
        return cfg
    if cfg["model_type"] != "llama" and "first_k_dense_replace" not in base:
        cfg["first_k_dense_replace"] = layers  # every layer dense: no MoE kernels
    return cfg


def kv_row_bytes(kind: str) -> dict:
    """Bytes of KV cache per token and layer (MLA: one row; MHA: K and V), and per token in all layers."""
    cfg = config(kind)
    if cfg["model_type"].startswith("deepseek"):
        row = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2
    else:
        row = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    return {"row": row, "token": row * cfg["num_hidden_layers"], "layers": cfg["num_hidden_layers"]}


def corpus(lines: int = 4000, seed: int = 7):
    """Deterministic text to train the tokenizer on: words of a made-up language."""
    import random

    rng = random.Random(seed)
    syllables = [a + b for a in "bdfgklmnprstvz" for b in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    for _ in range(lines):
        yield " ".join(rng.choice(words) for _ in range(rng.randint(5, 25)))


def train_tokenizer(vocab: int = VOCAB):
    """A byte-level BPE tokenizer of exactly ``vocab`` ids (``tokenizers``), special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, not {vocab}")
    return tok


def make(kind: str, dest: Path, tokenizer=None, release: str | None = None) -> Path:
    """Writes config.json, generation_config.json and the tokenizer files for ``kind`` (as served by SGLang
    ``release``) into ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config(kind, release), indent=1) + "\n")
    (dest / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": EOS}) + "\n")
    (tokenizer or train_tokenizer()).save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<pad>", "model_max_length": CONTEXT, "add_bos_token": False, "clean_up_tokenization_spaces": False,
    }, indent=1) + "\n")
    (dest / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}) + "\n")
    return dest


def make_all(root: Path, kinds=tuple(SHAPES), release: str | None = None) -> dict:
    """Every kind under ``root/<kind>``, one tokenizer trained for all."""
    tok = train_tokenizer()
    return {kind: str(make(kind, Path(root) / kind, tok, release)) for kind in kinds}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in SHAPES:
        print(make(sys.argv[1], Path(sys.argv[2])))
    elif len(sys.argv) == 3 and sys.argv[1] == "all":
        print(json.dumps(make_all(Path(sys.argv[2]))))
    else:
        sys.exit(f"usage: models.py {{{'|'.join(SHAPES)}|all}} DIR")
