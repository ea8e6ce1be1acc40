"""verl 0.9.1's remove-padding path under sdpa, through verl's own functions: packed == padded.

`rl.verl.remove_padding: auto` turns verl's use_remove_padding on under sdpa for the families in
PACKED_SDPA_FAMILIES (stages/core/config/rl_engine.py). There verl's FSDP engine packs a micro-batch into one row,
passes `attention_mask=None` with position ids that restart at 0 per sequence and `use_cache=False`
(workers/engine/fsdp/transformer_impl.py:1182-1260, :1566-1569), and transformers 5.9 then builds a block-diagonal
causal mask from those position ids (masking_utils.py:880-888, `find_packed_sequence_indices` :757). No flash-attn
anywhere (verl's unpad helpers fall back to torch: utils/attention_utils.py:70-78; log-probs to log_softmax + gather:
utils/torch_functional.py:95-106). Each family's random-init toy (2 layers, width 64) gets a batch laid out as verl's
trainer hands it to the actor (left-padded prompts, right-padded responses), converted by verl's
`left_right_2_no_padding`, run by the engine's `forward_step` with use_remove_padding on and off, and re-padded by
`no_padding_2_padding`: log-probs, entropies and the gradient of a loss over them agree per real token.

The engine is built bare (no FSDP, no process group): forward_step reads only the module, the engine config's
entropy settings, `pad_to_length`, `use_ulysses_sp`, the autocast dtype and the device (monkeypatched to cpu).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from stages.core.config.rl_engine import PACKED_SDPA_FAMILIES

pytestmark = pytest.mark.verl
VOCAB = 128
PROMPT, RESPONSE = 6, 9                         # padded widths
PROMPTS, RESPONSES = [6, 3, 5], [9, 4, 1]       # real lengths: three sequences of 15, 7 and 6 tokens


def toy_model(family: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=64, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def verl_batch():
    """The actor's input as verl's trainer holds it, in verl's no-padding layout (nested tensors)."""
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(1)
    rows = len(PROMPTS)
    prompts, responses = torch.zeros(rows, PROMPT, dtype=torch.long), torch.zeros(rows, RESPONSE, dtype=torch.long)
    attention = torch.zeros(rows, PROMPT + RESPONSE, dtype=torch.long)
    response_mask = torch.zeros(rows, RESPONSE, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        prompts[i, PROMPT - p:] = torch.randint(1, VOCAB, (p,), generator=g)
        responses[i, :r] = torch.randint(1, VOCAB, (r,), generator=g)
        attention[i, PROMPT - p:PROMPT + r] = 1
        response_mask[i, :r] = 1
    td = TensorDict({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                     "attention_mask": attention, "response_mask": response_mask,
                     "position_ids": (attention.cumsum(-1) - 1).clamp(min=0)}, batch_size=[rows])
    return left_right_2_no_padding(td)


def bare_engine(module, monkeypatch):
    import verl.utils.torch_functional as verl_F
    import verl.workers.engine.fsdp.transformer_impl as impl
    from verl.workers.config import FSDPEngineConfig

    monkeypatch.setattr(impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(impl, "get_device_name", lambda: "cpu")
    engine = object.__new__(impl.FSDPEngineWithLMHead)
    engine.module = module
    engine.engine_config = FSDPEngineConfig(use_torch_compile=False)
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits   # what __init__ picks without chunking
    engine.pad_to_length, engine.use_ulysses_sp, engine.ulysses_device_mesh = False, False, None
    engine._autocast_dtype = torch.float32
    return engine


def micro_batch(td, remove_padding: bool):
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    mb = td.clone()
    tu.assign_non_tensor(mb, use_remove_padding=remove_padding, pad_mode=DatasetPadMode.NO_PADDING,
                         calculate_entropy=True, use_fused_kernels=False, temperature=1.0)
    return mb


def run(engine, td, remove_padding: bool, grad: bool):
    """(log-probs, entropies) re-padded to [rows, RESPONSE], and the flat parameter gradient of a loss over both."""
    from verl.workers.utils.padding import no_padding_2_padding

    mb = micro_batch(td, remove_padding)
    engine.module.zero_grad()

    def loss_fn(model_output, data, dp_group=None):
        mask = data["response_mask"].float()
        values = no_padding_2_padding(model_output["log_probs"], data) + \
            0.1 * no_padding_2_padding(model_output["entropy"], data)
        return (values * mask).sum(), {}

    if grad:
        loss, out = engine.forward_step(mb, loss_fn, forward_only=False)
        loss.backward()
    else:
        with torch.no_grad():
            _, out = engine.forward_step(mb, None, forward_only=True)
    model_output = out["model_output"]
    flat = torch.cat([p.grad.flatten() for p in engine.module.parameters()]) if grad else None
    return (no_padding_2_padding(model_output["log_probs"], mb), no_padding_2_padding(model_output["entropy"], mb),
            flat)


def test_the_remove_padding_path_needs_no_flash_attn():
    import verl.utils.torch_functional as verl_F

    assert importlib.util.find_spec("flash_attn") is None
    assert not verl_F.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE    # log_softmax + gather, not flash-attn's kernel


@pytest.mark.parametrize("family", PACKED_SDPA_FAMILIES)
def test_packed_equals_padded_under_sdpa_through_verls_engine(family, monkeypatch):
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    model = toy_model(family)
    apply_monkey_patch(model=model, use_remove_padding=True)   # as the engine's _build_module does (:324-330)
    assert model.config._attn_implementation == "sdpa"          # the patch replaces only flash-attention's forward
    engine, td = bare_engine(model, monkeypatch), verl_batch()
    real = td["response_mask"].bool()

    inputs, _ = engine.prepare_model_inputs(micro_batch(td, True))    # one row, no mask, positions restart at 0
    total = sum(PROMPTS) + sum(RESPONSES)
    assert inputs["input_ids"].shape == (1, total) and inputs["attention_mask"] is None
    starts = [0, *torch.tensor([p + r for p, r in zip(PROMPTS, RESPONSES)]).cumsum(0)[:-1].tolist()]
    assert (inputs["position_ids"][0, starts] == 0).all()

    packed_lp, packed_ent, _ = run(engine, td, True, grad=False)
    padded_lp, padded_ent, _ = run(engine, td, False, grad=False)
    assert (packed_lp - padded_lp)[real].abs().max() < 1e-5        # measured 4.8e-7 (fp32)
    assert (packed_ent - padded_ent)[real].abs().max() < 1e-5
    assert packed_lp[real].abs().min() > 1.0                      # real log-probs of a 128-token vocabulary

    _, _, packed_grad = run(engine, td, True, grad=True)
    _, _, padded_grad = run(engine, td, False, grad=True)
    assert (packed_grad - padded_grad).abs().max() < 1e-5 * padded_grad.abs().max()   # measured ~5e-7 relative

    # the control: transformers looks for packed sequences only without a cache (masking_utils.py:884); with one
    # (use_cache left on) the same row gets a plain causal mask and the second sequence attends to the first
    with torch.no_grad():
        kept = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False).logits
        mixed = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=True).logits
    assert (mixed - kept)[0, :starts[1]].abs().max() < 1e-5                # the first sequence sees only itself
    assert (mixed - kept)[0, starts[1]:].abs().max() > 1e-2
