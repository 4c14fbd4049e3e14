"""What determines the embedded tiny model (pace/tiny.py builds it): a plain dataclass, importable
without torch or transformers, so the configuration schema (and a bad-input error) loads fast."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Optional

from pace.tasks.arithmetic import ArithmeticSpec
from pace.tasks.tool_arithmetic import ToolArithmeticSpec

# Bump when the build procedure changes what it produces, so old caches are not reused.
BUILD_VERSION = 1


@dataclass
class TinySpec:
    """Everything that determines the built model; its hash names the cache directory."""

    task: ArithmeticSpec = field(default_factory=ArithmeticSpec)  # levels mixed in SFT and eval
    # Qwen3 shape (~0.4M parameters). head_dim 32: vLLM's CPU attention supports 32, 64, ...
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    max_position_embeddings: int = 256
    # SFT warm start; sft_steps sets how far the model gets. 1,500 steps with error_fraction = 0.4:
    # the model can do every level but samples slips, ~37% correct at temperature 1
    sft_steps: int = 1500
    batch_size: int = 64
    lr: float = 3e-3  # peak; linear warmup, cosine decay to lr/10
    warmup_steps: int = 30
    weight_decay: float = 0.0
    # accuracy measurement after SFT: first eval_prompts training prompts (a balanced mix)
    eval_prompts: int = 400
    eval_max_new_tokens: int = 96
    seed: int = 0
    # The tool-use variant: SFT on the tool task instead of `task`, `tool_fraction` of
    # the traces calling the tool and the rest answering directly (see pace/tasks/tool_arithmetic).
    tool: Optional[ToolArithmeticSpec] = None
    tool_fraction: float = 0.25
    # This fraction of the arithmetic SFT traces answers at once ("Answer: N", no worked
    # steps), which the model cannot compute for the longer levels: a sampled strategy whose
    # mistakes RL can remove by choosing the worked solution. 0: every trace is worked.
    direct_fraction: float = 0.0
    # This fraction of the arithmetic SFT traces has one worked step with a wrong result (1-9 too
    # high, the rest of the chain consistent with it): sampled slips RL can remove (without them,
    # 700 SFT steps gave a model RL hardly moved).
    error_fraction: float = 0.4
    # A Qwen3-MoE instead (0: the dense Qwen3): the dense model of the other fields upcycled, every
    # expert of a layer a copy of its MLP, `experts_per_token` routed per token (pace/tiny_moe.py)
    experts: int = 0
    experts_per_token: int = 2

    def key(self) -> str:
        fields = asdict(self)
        if self.tool is None:  # the arithmetic model's key (and cache) predates the tool variant
            del fields["tool"], fields["tool_fraction"]
        for name in ("direct_fraction", "error_fraction"):  # knobs added later: earlier caches stay valid
            if not fields[name]:
                del fields[name]
        if not self.experts:  # the dense models' keys predate the MoE variant
            del fields["experts"], fields["experts_per_token"]
        blob = json.dumps({"build_version": BUILD_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def dense(self) -> "TinySpec":
        """The dense model an MoE spec is upcycled from (itself for a dense spec)."""
        from dataclasses import replace

        return replace(self, experts=0)
