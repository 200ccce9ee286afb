"""`sparse-rl model init`: small random-initialised causal LMs with a locally trained tokenizer.

Everything is built offline: the tokenizer is a byte-level BPE trained with `tokenizers` on the
built-in corpus (digits split one by one, which small models need for arithmetic), with ChatML
special tokens and a chat template; the model is a stock Hugging Face architecture, so the
directory loads with plain `AutoModelForCausalLM` / `AutoTokenizer`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from sparse_rl.errors import UsageError

ARCHS = ("llama", "qwen2", "qwen3", "mistral")

# name: (vocab, hidden, intermediate, layers, heads, kv_heads); head_dim = hidden // heads.
PRESETS: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (512, 64, 192, 4, 4, 2),  # ~0.26M params: tests and the CPU demo
    "small": (2048, 256, 768, 6, 8, 2),  # ~5.5M
    "medium": (4096, 512, 1536, 8, 8, 2),  # ~28M
    "base": (8192, 768, 2048, 12, 12, 4),  # ~88M: GPU experiments
    "large": (8192, 1024, 2816, 24, 16, 4),  # ~280M: multi-GPU runs (recipes/multi_gpu)
}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, with OpenAI-style tool calls rendered as JSON inside <tool_call> tags.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}{{ '\\n' }}"
    "{% if message.get('content') %}{{ message['content'] }}{% endif %}"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "{{ '\\n' }}<tool_call>{{ call['function'] | tojson }}</tool_call>"
    "{% endfor %}{% endif %}"
    "<|im_end|>{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


@dataclass
class ModelInitConfig:
    arch: str = "llama"
    size: str = "tiny"
    seed: int = 0
    vocab_size: int | None = None  # default: the preset's
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    dtype: str = "float32"  # weights on disk: float32 | bfloat16

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise UsageError(f"--arch {self.arch}: expected one of {', '.join(ARCHS)}")
        if self.size not in PRESETS:
            raise UsageError(f"--size {self.size}: expected one of {', '.join(PRESETS)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise UsageError(f"--dtype {self.dtype}: expected float32 or bfloat16")
        if self.vocab_size is not None and self.vocab_size < 300:
            raise UsageError("--vocab-size must be at least 300 (256 bytes + special tokens)")


def train_tokenizer(vocab_size: int, seed: int = 0):
    """Byte-level BPE trained on the built-in corpus; returns a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from sparse_rl.corpus import builtin_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(builtin_text(3000, seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 20
    return fast


def build_config(cfg: ModelInitConfig, tokenizer):
    from transformers import AutoConfig

    vocab, hidden, inter, layers, heads, kv = PRESETS[cfg.size]
    # The embedding is sized to the tokenizer, rounded up to a multiple of 64 for GPU-friendly shapes.
    n_vocab = ((len(tokenizer) + 63) // 64) * 64
    kw = dict(vocab_size=n_vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
              max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False,
              eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
              pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), bos_token_id=None,
              rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    if cfg.arch == "mistral":
        kw["sliding_window"] = None
    if cfg.arch in ("qwen2", "qwen3"):
        kw["use_sliding_window"] = False
    return AutoConfig.for_model(cfg.arch, **kw)


def init_model(out: str | Path, cfg: ModelInitConfig, force: bool = False) -> dict:
    """Write a random-init model dir at `out` (atomically). Returns a summary dict."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    from sparse_rl.io import atomic_dir

    hf_logging.disable_progress_bar()

    vocab = cfg.vocab_size or PRESETS[cfg.size][0]
    with atomic_dir(out, force=force, flag="OUT") as tmp:
        tokenizer = train_tokenizer(vocab, seed=cfg.seed)
        config = build_config(cfg, tokenizer)
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config = GenerationConfig(
            eos_token_id=[config.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")],
            pad_token_id=config.pad_token_id, do_sample=False)
        if cfg.dtype == "bfloat16":
            model = model.to(torch.bfloat16)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        n_params = sum(p.numel() for p in model.parameters())
    return {"out": str(out), "arch": cfg.arch, "size": cfg.size, "params": n_params,
            "vocab_size": config.vocab_size, "tokenizer_vocab": len(tokenizer), "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim}


def config_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(ModelInitConfig)]
