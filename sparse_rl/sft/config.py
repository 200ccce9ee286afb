"""`SFTConfig`: the one source of truth for `sparse-rl sft`'s options (YAML keys = field names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from sparse_rl.errors import UsageError

FINETUNE = ("full", "lora")
# a resumed run must train the same thing on the same rows
FIXED_ON_RESUME = ("model", "data", "loss_on", "seq_len", "batch_size", "seed", "finetune", "lora_r", "lora_alpha",
                   "lora_targets")


@dataclass
class SFTConfig:
    """model: dense (or sparse) model dir. data: JSONL (messages | prompt+completion/solution | text).
    out: the trained model dir (full weights; LoRA runs merge the adapter into it and also write
    `out/adapter/`). run_dir: config.yaml, metrics.jsonl, checkpoints (default `OUT.run`)."""

    model: Optional[str] = None
    data: Optional[str] = None
    out: Optional[str] = None
    run_dir: Optional[str] = None
    loss_on: str = "assistant"      # assistant (assistant turns; all of `text` records) | all (every token: pre-training)
    seq_len: int = 2048             # tokens per packed row
    batch_size: int = 8             # rows per process per step
    steps: int = 0                  # optimizer steps; 0 = `epochs` passes over the packed rows
    epochs: float = 1.0
    lr: float = 2e-5
    min_lr_ratio: float = 0.1       # cosine decay to lr * min_lr_ratio
    lr_warmup: int = 0              # linear warm-up steps
    weight_decay: float = 0.0
    adam_beta2: float = 0.999       # AdamW's second-moment decay (HF TrainingArguments' name); 0.95 for pre-training
    grad_clip: float = 1.0          # 0 = off
    finetune: str = "full"          # full | lora
    lora_r: int = 16
    lora_alpha: int = 32
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    seed: int = 0
    log_every: int = 1
    save_every: int = 100
    keep_checkpoints: int = 2
    device: str = "auto"
    dtype: str = "auto"             # weights during training; the optimizer state follows them
    mixed_precision: str = "no"     # no | bf16: matmuls and attention under bf16 autocast, float32 weights kept

    def __post_init__(self):
        if self.loss_on not in ("assistant", "all"):
            raise UsageError(f"--loss-on {self.loss_on}: expected assistant or all")
        if self.mixed_precision not in ("no", "bf16"):
            raise UsageError(f"--mixed-precision {self.mixed_precision}: expected no or bf16")
        if self.finetune not in FINETUNE:
            raise UsageError(f"--finetune {self.finetune}: expected full or lora")
        for name in ("seq_len", "batch_size", "log_every", "save_every", "lora_r"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(self, name)}")
        if self.steps < 0 or self.epochs <= 0:
            raise UsageError("--steps must be >= 0 and --epochs > 0")
        if not 0 < self.adam_beta2 < 1:
            raise UsageError(f"--adam-beta2: expected a value in (0, 1), got {self.adam_beta2}")
        if self.lr <= 0:
            raise UsageError(f"--lr: must be positive, got {self.lr}")
