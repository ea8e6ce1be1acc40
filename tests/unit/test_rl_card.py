"""The algorithm card (stages/rl/card.py): hand-checked rows for the shipped profiles, the verl engine read back
from the overrides the verl mapping produces, and the same card on both engines for the same config."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stages.core.config.loader import load_config
from stages.rl.card import algorithm_card, card_markdown, card_table, trained_local, trained_verl


def rows(rl) -> dict[str, tuple[str, str]]:
    return {r.mechanism: (r.verdict, r.why) for r in algorithm_card(rl).rows}


def test_tiny_profile_card_names_each_difference() -> None:
    card = algorithm_card(load_config("tiny-cpu").rl)
    assert card.reference.name == "arpo-qwen2.5-7b-reasoning" and card.engine == "local"
    got = rows(load_config("tiny-cpu").rl)
    # tiny-cpu: n = 4 / 2 roots / 2 calls against 16 / 8 / 3; the stale baseline and the aggregation always differ
    differs = {m for m, (v, _) in got.items() if v == "differs"}
    assert differs == {"engine", "group size and initial roots", "tool calls per trajectory",
                       "entropy baseline H_initial", "loss aggregation"}
    assert "micro_token_mean reproduces it" in got["loss aggregation"][1]
    assert got["branch rule"][0] == got["copies per candidate"][0] == got["entropy quantity"][0] == "same"


def test_aepo_profile_entropy_aware_advantage_choice() -> None:
    # the profile runs the paper's method; the published run trained without it (entropy_coeff = 0)
    got = rows(load_config("aepo-qwen3-14b-deepsearch").rl)
    assert got["entropy-aware advantage"][0] == "differs"
    assert "entropy_aware=false to reproduce" in got["entropy-aware advantage"][1]
    published = rows(load_config("aepo-qwen3-14b-deepsearch", ["rl.advantage.entropy_aware=false"]).rl)
    assert published["entropy-aware advantage"] == ("same", "")
    # rollout rules equal the reference's at its setting; surprisal is the verl default profile's quantity
    assert got["branch rule"][0] == got["penalty counter c"][0] == got["group size and initial roots"][0] == "same"
    assert "batch added one" in got["penalty counter c"][1]                          # the kept nuance, as a note
    assert got["entropy quantity"][0] == "differs" and "top-k server" in got["entropy quantity"][1]
    earlier = rows(load_config("aepo-qwen3-14b-deepsearch", ["rl.rollout.penalty_counter=branches"]).rl)
    assert earlier["penalty counter c"][0] == "differs"


@pytest.mark.parametrize("profile", ["arpo-qwen2.5-7b-reasoning", "arpo-qwen3-14b-deepsearch",
                                     "aepo-qwen3-14b-deepsearch"])
def test_same_card_on_both_engines(profile) -> None:
    rl = load_config(profile).rl
    assert rl.engine == "verl"
    local = rl.model_copy(update={"engine": "local"})
    # everything but where it was read
    assert replace(trained_verl(rl), source="") == replace(trained_local(local), source="")
    verl_rows, local_rows = algorithm_card(rl).rows, algorithm_card(local).rows
    assert [r for r in verl_rows if r.mechanism != "engine"] == [r for r in local_rows if r.mechanism != "engine"]
    # the profile compares with its own script: every rollout setting is the published one
    assert all(r.verdict == "same" for r in verl_rows if r.mechanism in (
        "group size and initial roots", "branch rule", "tool calls per trajectory", "policy loss", "KL penalty"))


def test_verl_card_reads_what_the_mapping_sets() -> None:
    rl = load_config("arpo-qwen3-14b-deepsearch", ["rl.loss.aggregation=seq_mean_token_mean",
                                                  "rl.loss.kl_coef=0.01", "rl.loss.clip_ratio_high=0.28"]).rl
    t = trained_verl(rl)   # parsed from verl_overrides: loss_agg_mode, kl_loss_*, clip_ratio_*
    assert (t.aggregation, t.kl_coef, t.kl_type, t.clip) == ("seq_mean_token_mean", 0.01, "k3", (0.2, 0.28, 3.0))
    got = rows(rl)
    assert got["KL penalty"][0] == got["policy loss"][0] == got["loss aggregation"][0] == "differs"
    text = card_markdown(algorithm_card(rl))
    assert "0.01 x k3 (low_var_kl: clamped to [-10, 10])" in text and "eps_high = 0.28" in text


def test_card_table_and_notes() -> None:
    rl = load_config("tiny-cpu", ["rl.rollout.beam_size=1", "rl.rollout.initial_rollouts=4"]).rl
    card = algorithm_card(rl)
    assert any("beam_size=1" in note for note in card.notes) and any("no budget" in note for note in card.notes)
    table = card_table(card)
    assert set(table[0]) == {"mechanism", "this run", "reference", "verdict", "why", "link"}
    assert all(row["link"].startswith("docs/reference.md#") for row in table)
    assert "Notes:" in card_markdown(card)


def test_cli_shows_the_card(capsys) -> None:
    from flows.cli import main

    assert main(["config", "show", "--card", "-p", "aepo-qwen3-14b-deepsearch",
                 "-o", "rl.advantage.entropy_aware=false"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Algorithm card: aepo on the verl engine")
    assert "| entropy-aware advantage | off |" in out and "AEPO_Qwen3_14B_DeepResearch.sh" in out
