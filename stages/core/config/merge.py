"""The merge section: trainer checkpoint -> plain Hugging Face folder (stages/rl/merge.py). Its own module, so the
merge stage's key covers this model and not the RL section's."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from stages.core.config.section import Section


class MergeSection(Section):
    """Trainer checkpoint -> plain HF safetensors folder, checked by a log-prob parity probe."""

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="precision of the merged folder's weights (floating tensors only); the parity probe "
        "reports the rounding it costs apart from the merge's own error")
    parity_atol: float = Field(1e-4, gt=0, description="max |logp merged - logp trainer| on probe tokens")
