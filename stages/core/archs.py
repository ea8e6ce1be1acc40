"""The architectures the shipped profiles train, as their published config.json files state them (docs/plan.md
"Memory": the source of each row), and the parameter count they imply.

Only what the memory model and the rehearsals' toy models (stages/bootstrap/toy.py) read: widths, depths, heads,
vocabulary (the logits' width is config.json's `vocab_size`, which may exceed the tokenizer's), tied embeddings,
q/k/v biases (Qwen2) or q/k norms (Qwen3), the architecture family and the context length.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    hidden: int              # hidden_size
    layers: int              # num_hidden_layers
    intermediate: int        # intermediate_size (SwiGLU: gate, up, down)
    heads: int               # num_attention_heads
    kv_heads: int            # num_key_value_heads
    vocab: int               # vocab_size: the width of the logits
    head_dim: int = 0        # head_dim (0: hidden // heads)
    tied: bool = False       # tie_word_embeddings
    qkv_bias: bool = False   # Qwen2: q/k/v projections have biases
    qk_norm: bool = False    # Qwen3: RMSNorm over q and k per head
    model_type: str = ""     # config.json's model_type (transformers' architecture family)
    max_positions: int = 0   # max_position_embeddings

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.dim

    @property
    def layer_params(self) -> int:
        """One decoder layer: attention (q, k, v, o), SwiGLU MLP (3 matrices), two RMSNorms."""
        h, q, kv = self.hidden, self.heads * self.dim, self.kv_width
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0) + (2 * self.dim if self.qk_norm
                                                                                     else 0)
        return attn + 3 * h * self.intermediate + 2 * h

    @property
    def root_params(self) -> int:
        """What sits outside the decoder layers: embedding, final norm, and the LM head unless tied."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params


# name (lower case, "-instruct" dropped) -> config.json (docs/plan.md "Memory" links each file)
ARCHS: dict[str, Arch] = {
    # Tool-Star's released sizes (Qwen2.5-Instruct 0.5B, 1.5B, 3B): the three tie the LM head to the embedding
    "qwen2.5-0.5b": Arch(hidden=896, layers=24, intermediate=4864, heads=14, kv_heads=2, vocab=151936, tied=True,
                         qkv_bias=True, model_type="qwen2", max_positions=32768),
    "qwen2.5-1.5b": Arch(hidden=1536, layers=28, intermediate=8960, heads=12, kv_heads=2, vocab=151936, tied=True,
                         qkv_bias=True, model_type="qwen2", max_positions=32768),
    "qwen2.5-3b": Arch(hidden=2048, layers=36, intermediate=11008, heads=16, kv_heads=2, vocab=151936, tied=True,
                       qkv_bias=True, model_type="qwen2", max_positions=32768),
    "qwen2.5-7b": Arch(hidden=3584, layers=28, intermediate=18944, heads=28, kv_heads=4, vocab=152064,
                       qkv_bias=True, model_type="qwen2", max_positions=32768),
    "qwen3-8b": Arch(hidden=4096, layers=36, intermediate=12288, heads=32, kv_heads=8, vocab=151936, head_dim=128,
                     qk_norm=True, model_type="qwen3", max_positions=40960),
    "qwen3-14b": Arch(hidden=5120, layers=40, intermediate=17408, heads=40, kv_heads=8, vocab=151936, head_dim=128,
                      qk_norm=True, model_type="qwen3", max_positions=40960),
    "llama3.1-8b": Arch(hidden=4096, layers=32, intermediate=14336, heads=32, kv_heads=8, vocab=128256,
                        model_type="llama", max_positions=131072),
    "smollm2-135m": Arch(hidden=576, layers=30, intermediate=1536, heads=9, kv_heads=3, vocab=49152, tied=True,
                         model_type="llama", max_positions=8192),
}


# the released ARPO / AEPO / Tool-Star checkpoints (docs/reference.md "Published numbers": their hub ids) are
# fine-tunes that keep their base model's config.json: their name -> the base's entry above
RELEASED: dict[str, str] = {
    "qwen3-14b-arpo-deepsearch": "qwen3-14b", "qwen3-14b-aepo-deepsearch": "qwen3-14b",
    "qwen3-8b-arpo-deepsearch": "qwen3-8b", "qwen3-8b-aepo-deepsearch": "qwen3-8b",
    "qwen2.5-7b-arpo": "qwen2.5-7b", "qwen2.5-7b-aepo": "qwen2.5-7b", "qwen2.5-3b-arpo": "qwen2.5-3b",
    "llama3.1-8b-arpo": "llama3.1-8b", "tool-star-qwen-0.5b": "qwen2.5-0.5b", "tool-star-qwen-1.5b": "qwen2.5-1.5b",
    "tool-star-qwen-3b": "qwen2.5-3b", "tool-star-qwen-7b": "qwen2.5-7b",
}


def arch_for(*names: str | None) -> tuple[str, Arch] | None:
    """The table's entry for a model name or hub path ('Qwen/Qwen3-14B', 'Qwen2.5-7B-Instruct', a released
    checkpoint such as 'dongguanting/Qwen3-14B-ARPO-DeepSearch'); None if absent."""
    for name in names:
        if not name:
            continue
        key = name.rstrip("/").split("/")[-1].lower().removesuffix("-instruct")
        key = RELEASED.get(key, key)
        if key in ARCHS:
            return key, ARCHS[key]
    return None
