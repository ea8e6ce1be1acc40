"""A published recipe as a whole, against a run's resolved config: every setting of the scripts a paper's authors
shipped (SFT, DPO, RL schedule, evaluation), its value in this run, and same / differs with why, in the style of
the RL algorithm card (stages/rl/card.py, which compares the RL mechanisms). `arpo config show --card` prints it
under the algorithm card when `rl.reference_setting` names a run that has a recipe here.

Tool-Star: RUC-NLPIR/Tool-Star commit 8e5936f; every value's file and line in docs/reference.md "Tool-Star's recipe".
Pure data and config reads: no stage code, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from stages.core.archs import arch_for
from stages.core.engine_spec import ENGINES
from stages.core.registry import Registry

TOOLSTAR = "RUC-NLPIR/Tool-Star@8e5936f"
SFT_YAML = "qwen_sft_tool_star.yaml"
DPO_YAML = "qwen_lora_dpo_2.yaml"
RL_SH = "run_tool_star.sh"
TRAIN_SH = "train.sh"
RELEASED_SIZES = ("Qwen2.5-0.5B-Instruct", "Qwen2.5-1.5B-Instruct", "Qwen2.5-3B-Instruct", "Qwen2.5-7B-Instruct")


@dataclass(frozen=True)
class Item:
    """One published setting. `ours` reads the run's value (text) from the config; it is the same as `published`
    when `same(cfg)` says so (default: the texts are equal). `why` explains a difference and what reproduces the
    published value; `unpublished`: the authors did not publish a value (the row says so instead of a verdict)."""

    stage: str
    setting: str
    published: str
    source: str
    ours: Callable[[Any], str]
    why: str = ""
    same: Callable[[Any], bool] | None = None
    unpublished: bool = False

    def verdict(self, cfg: Any) -> str:
        if self.unpublished:
            return "not published"
        same = self.same(cfg) if self.same is not None else self.ours(cfg) == self.published
        return "same" if same else "differs"


@dataclass(frozen=True)
class Recipe:
    name: str
    code: str
    items: tuple[Item, ...]


def _g(value: float) -> str:
    return f"{value:g}"


def _file(path: str | None) -> str:
    return PurePath(path).name if path else "none"


def _sft_gpus(cfg: Any) -> int:
    return cfg.sft.nproc_per_node if cfg.sft.launcher == "torchrun" else 1


def _batch(per_device: int, accumulation: int, gpus: int) -> str:
    return f"{per_device} x {accumulation} x {gpus} = {per_device * accumulation * gpus}"


def _model_type(cfg: Any) -> str | None:
    found = arch_for(cfg.model.name, cfg.model.path)
    return found[1].model_type if found else None


def _helper(cfg: Any) -> str:
    aids = cfg.agent.inference
    return aids.llm_model or aids.llm_url or "the served policy"


TOOLSTAR_ITEMS: tuple[Item, ...] = (
    # --- model and data
    Item("model", "base model", "Qwen2.5-3B-Instruct (released: 0.5B, 1.5B, 3B, 7B)", f"{SFT_YAML} 2; README",
         lambda c: c.model.name, same=lambda c: c.model.name in RELEASED_SIZES),
    Item("data", "RL train set", "Multi-Tool-RL-10K = grpo_mix_train_shuffle.parquet", f"{RL_SH} 26",
         lambda c: _file(c.data.train_path), why="another file than the 10,000 rows of Multi-Tool-RL-10K",
         same=lambda c: _file(c.data.train_path) == "train_10k.parquet"),
    Item("data", "validation set", "grpo_mix_test.parquet (180 rows)", f"{RL_SH} 27",
         lambda c: _file(c.data.valid_path), why="another validation file",
         same=lambda c: _file(c.data.valid_path) == "valid.parquet"),
    Item("data", "system prompt", "re_search_template_sys, as the chat template's system turn",
         f"template.py 21-29; rl_dataset.py 159-162; {RL_SH} 14-15", lambda c: c.data.system_prompt,
         why="another prompt than re_search_template_sys (= configs/templates/tir_search_python)",
         same=lambda c: c.data.system_prompt == c.agent.prompt_template == "tir_search_python"),
    # --- cold-start SFT (LLaMA-Factory)
    Item("sft", "fine-tuning", "full", f"{SFT_YAML} 8", lambda c: c.sft.finetuning_type),
    Item("sft", "DeepSpeed", "ZeRO-3 (ds_z3_config.json)", f"{SFT_YAML} 9", lambda c: _file(c.sft.deepspeed),
         same=lambda c: _file(c.sft.deepspeed) == "ds_z3.json", why="another DeepSpeed file: memory, not the update"),
    Item("sft", "dataset", "Tool-Star-SFT-54K (alpaca)", f"{SFT_YAML} 12; README",
         lambda c: f"{_file(c.sft.dataset_path)} ({c.sft.dataset_format})",
         same=lambda c: c.sft.dataset == "file" and c.sft.dataset_format == "alpaca",
         why="not the Tool-Star SFT file"),
    Item("sft", "chat template", "qwen", f"{SFT_YAML} 13", lambda c: c.sft.template or c.model.template),
    Item("sft", "cutoff", "15000", f"{SFT_YAML} 14", lambda c: str(c.sft.cutoff_len)),
    Item("sft", "loss on <result> text", "yes (one assistant turn; Tool-Star issue #8)", "README; issue #8",
         lambda c: "no (masked)" if c.sft.mask_tool_results else "yes (one assistant turn; Tool-Star issue #8)",
         why="sft.mask_tool_results=true masks the tool results"),
    Item("sft", "batch per device x accumulation x GPUs", "1 x 4 x 4 = 16", f"{SFT_YAML} 27-28; train_sft.sh 5",
         lambda c: _batch(c.sft.per_device_train_batch_size, c.sft.gradient_accumulation_steps, _sft_gpus(c))),
    Item("sft", "learning rate, epochs", "7e-06, 3", f"{SFT_YAML} 29-30",
         lambda c: f"{_g(c.sft.learning_rate)}, {_g(c.sft.num_train_epochs)}"),
    Item("sft", "schedule, warm-up", "cosine, 0.1", f"{SFT_YAML} 31-32",
         lambda c: f"{c.sft.lr_scheduler_type}, {_g(c.sft.warmup_ratio)}"),
    Item("sft", "bf16", "True", f"{SFT_YAML} 33", lambda c: str(c.sft.bf16)),
    # --- self-critic DPO (LLaMA-Factory, optional in Tool-Star's README)
    Item("dpo", "self-critic DPO", "on, after SFT, from the SFT checkpoint", f"README; {DPO_YAML} 2",
         lambda c: "on, after SFT, from the SFT checkpoint" if c.sft.dpo.enabled else "off",
         why="sft.dpo.enabled=false: SFT + vanilla RL, which Tool-Star's README says almost reproduces its numbers"),
    Item("dpo", "schedule", "one round on the SFT checkpoint (released yaml); the paper interleaves it with GRPO",
         f"{DPO_YAML} 2; {TRAIN_SH}; README (paper Appendix B.1)",
         lambda c: "one round between SFT and RL" if c.sft.dpo.enabled else "none",
         why="the released scripts have no interleaving (train.sh is vanilla GRPO, the DPO yaml starts from the SFT "
             "checkpoint); the pipeline runs the round the released yaml runs",
         same=lambda c: False),
    Item("dpo", "pairs", "reward-labelled self-samples (Appendix B.1 / E.2; no sampling script released)", "README",
         lambda c: (f"{c.sft.dpo.samples_per_question} samples x {c.sft.dpo.max_questions} RL questions, "
                    f"(correct, incorrect) by the {c.sft.dpo.reward} reward, <= {c.sft.dpo.pairs_per_question} "
                    f"per question, fallback {c.sft.dpo.chosen_fallback}"), unpublished=True),
    Item("dpo", "LoRA rank, target", "8, all", f"{DPO_YAML} 8-10",
         lambda c: f"{c.sft.dpo.lora_rank}, {c.sft.dpo.lora_target}"),
    Item("dpo", "pref_beta, pref_loss", "0.1, sigmoid", f"{DPO_YAML} 11-12",
         lambda c: f"{_g(c.sft.dpo.beta)}, {c.sft.dpo.loss}"),
    Item("dpo", "cutoff", "8192", f"{DPO_YAML} 17", lambda c: str(c.sft.dpo.cutoff_len)),
    Item("dpo", "batch per device x accumulation x GPUs", "2 x 2 x 4 = 16", f"{DPO_YAML} 30-31; train_dpo.sh 3",
         lambda c: _batch(c.sft.dpo.per_device_train_batch_size, c.sft.dpo.gradient_accumulation_steps,
                          _sft_gpus(c))),
    Item("dpo", "learning rate, epochs", "5e-06, 3", f"{DPO_YAML} 32-33",
         lambda c: f"{_g(c.sft.dpo.learning_rate)}, {_g(c.sft.dpo.num_train_epochs)}"),
    Item("dpo", "DeepSpeed", "none", DPO_YAML, lambda c: _file(c.sft.deepspeed),
         why="the DPO stage runs with SFT's launcher and DeepSpeed file (sft.deepspeed): ZeRO-3 shards the frozen "
             "base and the LoRA; memory, not the update"),
    # --- vanilla RL (verl GRPO)
    Item("rl", "GPUs x nodes", "8 x 1", f"{RL_SH} 19-20",
         lambda c: f"{c.rl.verl.n_gpus_per_node} x {c.rl.verl.nnodes}" if ENGINES.get(c.rl.engine).cluster
         else f"1 ({c.rl.engine})"),
    Item("rl", "train batch, PPO mini-batch, n", "128, 16, 8", f"{RL_SH} 11-13",
         lambda c: f"{c.rl.trainer.train_batch_size}, {c.rl.trainer.ppo_mini_batch_size}, {c.rl.rollout.n}"),
    Item("rl", "epochs, checkpoint every", "2, 10 steps", f"{RL_SH} 21, 23",
         lambda c: f"{c.rl.trainer.epochs}, {c.rl.trainer.save_every} steps"),
    Item("rl", "prompt / response tokens", "1536 / 4096", f"{TRAIN_SH} 8-9",
         lambda c: f"{c.rl.rollout.max_prompt_length} / {c.rl.rollout.max_response_length}"),
    Item("rl", "learning rate, warm-up", "1e-06, none", f"{TRAIN_SH} 87; ppo_trainer.yaml 41-44",
         lambda c: f"{_g(c.rl.optim.lr)}, none"),
    Item("rl", "dynamic batch: tokens per GPU", "11264 = 2 (P + R)", f"{TRAIN_SH} 89-90",
         lambda c: f"{c.rl.verl.max_token_len_per_gpu} = 2 (P + R)",
         same=lambda c: c.rl.verl.max_token_len_per_gpu == 2 * (c.rl.rollout.max_prompt_length
                                                                  + c.rl.rollout.max_response_length),
         why="another token budget: speed and memory, not the update"),
    Item("rl", "log-prob passes: tokens per GPU", "22528 = 4 (P + R)", f"{TRAIN_SH} 97, 103",
         lambda c: f"{2 * (c.rl.verl.max_token_len_per_gpu or 0)} (old log-probs, 2x the update's)",
         why="stages/rl/verl/mapping.py gives the old-log-prob pass twice the update's budget (docs/plan.md "
             "\"Memory\"): speed and memory, not the values", same=lambda c: False),
    Item("rl", "reference model", "loaded, parameters offloaded; KL coefficient 0", f"{TRAIN_SH} 91-93, 104",
         lambda c: f"KL coefficient {_g(c.rl.loss.kl_coef)}: " + ("none loaded" if c.rl.loss.kl_coef == 0 else
                                                                 "loaded"),
         why="with a KL coefficient of 0 the reference model changes nothing, so none is loaded",
         same=lambda c: False),
    Item("rl", "vLLM rollout: memory share, TP", "0.9, 1", f"{TRAIN_SH} 98, 100",
         lambda c: f"{_g(c.rl.verl.gpu_memory_utilization)}, {c.rl.verl.rollout_tensor_parallel}",
         why="vLLM's share sits beside the FSDP actor's shard and AdamW state in the rollout: at 0.9 the 7B needs "
             "84.6 GiB of an 80 GiB GPU (`arpo plan`); 0.8 fits every released size. A smaller KV cache: speed only"),
    Item("rl", "rollout temperature, top_p", "1, 1", "ppo_trainer.yaml 67-69",
         lambda c: f"{_g(c.rl.rollout.temperature)}, {_g(c.rl.rollout.top_p)}"),
    Item("rl", "remove padding, gradient checkpointing", "True, True", f"{TRAIN_SH} 85-86",
         lambda c: f"{c.rl.verl.uses_remove_padding(_model_type(c))}, {c.rl.trainer.gradient_checkpointing}",
         why="rl.verl.remove_padding: auto packs micro-batches under sdpa for qwen2 (docs/decisions.md)"),
    Item("rl", "search in training", "Bing web search, top-10 snippets", "vllm_rollout.py 507; web_search_main.py 18, 57",
         lambda c: f"{c.agent.search.backend}, top {c.agent.search.top_k}",
         same=lambda c: c.agent.search.backend == "web" and c.agent.search.top_k == 10,
         why="another search backend or depth than Bing's top-10 snippets"),
    Item("rl", "tool calls per trajectory", "3, search and python together", "vllm_rollout.py 380-467",
         lambda c: f"{min(c.rl.rollout.call_limit, c.agent.limits.max_calls)}, search and python together",
         same=lambda c: min(c.rl.rollout.call_limit, c.agent.limits.max_calls) == 3),
    Item("rl", "in-training validation", "every 10 steps and before training, on grpo_mix_test",
         f"{RL_SH} 22; {TRAIN_SH} 117", lambda c: "none: the eval stage scores the benchmarks after training",
         why="verl's validation is off here (stages/rl/verl/mapping.py: test_freq -1): it picks no checkpoint, the "
             "last one is evaluated", same=lambda c: False),
    # --- evaluation (evaluation/run.py, README "TIR Evaluation")
    Item("eval", "benchmarks", "aime24, aime25, math500, gsm8k, math, webwalker, hotpotqa, 2wiki, musique, bamboogle",
         "README \"Inference Your Model\"", lambda c: ", ".join(c.eval.benchmarks)),
    Item("eval", "questions per benchmark", "500 math, 200 QA, 500 HLE", "README",
         lambda c: "benchmark defaults: 500 math, 200 QA, 500 HLE" if c.eval.max_questions is None else
         f"{c.eval.max_questions}", same=lambda c: c.eval.max_questions is None),
    Item("eval", "sampling", "greedy (T 0), top_p 0.8, top_k 20, min_p 0, repetition penalty 1.1, 1 run",
         "run.py 455-458, 527-537",
         lambda c: (f"{'greedy (T 0)' if c.eval.temperature == 0 else f'T {_g(c.eval.temperature)}'}, top_p "
                    f"{_g(c.eval.top_p)}, top_k {c.eval.top_k}, min_p {_g(c.eval.min_p)}, repetition penalty "
                    f"{_g(c.eval.repetition_penalty)}, {c.eval.samples} run" + ("s" if c.eval.samples > 1 else ""))),
    Item("eval", "tokens per call / context", "16384 / 16384", "README (--max_tokens, --max_input_len)",
         lambda c: f"{c.eval.max_tokens} / {c.serve.vllm.max_model_len}"),
    Item("eval", "tool calls per sample", "3 python + 3 search", "run.py 49-50",
         lambda c: f"{c.eval.max_python} python + {c.eval.max_search} search"),
    Item("eval", "search", "Wikipedia retriever (E5, FlashRAG) for hotpotqa, 2wiki, musique, bamboogle; Bing "
         "top-10 snippets for the others", "run.py 230-250; utils.py 20; Tool-Star issue #18",
         lambda c: f"{c.agent.search.backend} for all, top {c.agent.search.top_k}",
         why="one search backend per run: the four Wikipedia sets run with agent.search.backend=server (`arpo "
             "retriever serve` over a Wikipedia index, top_k 10) in a second evaluation", same=lambda c: False),
    Item("eval", "inference-time tools", "code debugger on; rollback and refiner off", "README (--use_debug)",
         lambda c: ("code debugger " + ("on" if c.agent.inference.debugger else "off") + "; rollback and refiner "
                    + ("on" if c.agent.inference.rollback or c.agent.inference.refiner else "off"))),
    Item("eval", "debugger's helper LLM", "Qwen2.5-3B-Instruct (README); debug_code.py names Qwen2.5-72B-Instruct "
         "(the README's copy of it: Qwen2.5-7B-Instruct)",
         "README 310 (\"LLM Service Deployment\"), 394 (its copy of debug_code.py); tools/debug_code.py 14", _helper,
         why="no second server by default: -o agent.inference.llm_url=http://<host>:<port>/v1 "
             "-o agent.inference.llm_model=Qwen2.5-3B-Instruct names one",
         same=lambda c: (c.agent.inference.llm_model or "") in RELEASED_SIZES),
    Item("eval", "judge", "Qwen2.5-72B-Instruct, evaluate.py's \"Correct\" / \"Incorrect\" prompt",
         "README; evaluate.py 92-100, 149-150",
         lambda c: f"{c.eval.judge.path or c.eval.judge.model}, ARPO's judge prompt (stages/eval/judge.py)",
         why="the pipeline's one judge prompt is ARPO's (llm_evaluator_sds.py); the verdict rule is the same "
             "(\"correct\" without \"incorrect\")", same=lambda c: False),
)

RECIPES: Registry[Recipe] = Registry("recipe", {
    "grpo-toolstar-qwen2.5-3b": Recipe("Tool-Star", TOOLSTAR, TOOLSTAR_ITEMS),
})


def recipe_rows(cfg: Any, recipe: Recipe) -> list[dict[str, str]]:
    return [{"stage": i.stage, "setting": i.setting, "this run": i.ours(cfg), "published": i.published,
             "source": i.source, "verdict": i.verdict(cfg),
             "why": i.why if i.verdict(cfg) == "differs" else ""} for i in recipe.items]


def recipe_markdown(cfg: Any, recipe: Recipe) -> str:
    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    rows = recipe_rows(cfg, recipe)
    lines = [f"# The {recipe.name} recipe against its published scripts", "",
             f"{recipe.code}; file:line of every value in docs/reference.md.", "",
             "| stage | setting | this run | published | source | verdict | why |", "|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cell(r[k]) for k in ("stage", "setting", "this run", "published", "source", "verdict",
                                                      "why")) + " |" for r in rows]
    differs = sum(r["verdict"] == "differs" for r in rows)
    unknown = sum(r["verdict"] == "not published" for r in rows)
    lines += ["", f"{differs} of {len(rows)} settings differ, {unknown} not published.", ""]
    return "\n".join(lines)


def recipe_for(reference_setting: str | None) -> Recipe | None:
    return RECIPES.get(reference_setting) if reference_setting and reference_setting in RECIPES else None
