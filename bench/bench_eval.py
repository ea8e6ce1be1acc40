"""Serving throughput and time to first token: vLLM's OpenAI server vs the transformers backend, one run.

    .venv/bin/python bench/bench_eval.py [--concurrency 1 8 32] [--max-tokens 96]

Same model (the tiny profile's SmolLM2-135M, fp32), same prompts (the `synthetic` questions in the TIR chat
template, ~300 tokens each), greedy, each request generating up to `--max-tokens` tokens (EOS may end it earlier;
throughput counts the tokens really generated). At concurrency c, c requests start together:
- baseline, `transformers`: our rollout backend (stages.generation.hf) in this process, the c prompts in one
  batched `generate` call; time to first token = the same batch with max_new_tokens=1 (prefill + one token);
- `vllm`: the tiny profile's vLLM server (serve.backend=vllm, started through stages.eval.serving), c concurrent
  streamed chat-free completions with the openai client; time to first token = median over the c requests.
Torch runs one thread in this process; vLLM binds its own worker to one core. Ratios are vLLM / baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import write_result
from stages.core.env import PROJECT_ROOT, configure_environment

configure_environment()


def prompts_for(tokenizer, questions: list[str], n: int) -> list[str]:
    from stages.agent.prompt_templates import build_messages

    return [tokenizer.apply_chat_template(build_messages(questions[i % len(questions)]), tokenize=False,
                                          add_generation_prompt=True) for i in range(n)]


def bench_transformers(model_path: str, prompts: list[str], max_tokens: int) -> tuple[float, float, int]:
    """(tokens/s, time to first token s, tokens) for one batched generate call over `prompts`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.generation import GenRequest, SamplingSpec, load_backend

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    backend = load_backend("transformers", model, tok, kv_reuse=False)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    greedy = SamplingSpec(temperature=0.0)
    backend.generate([GenRequest(0, ids[0], 2)], greedy)  # warm-up, as the server gets one
    start = time.perf_counter()
    backend.generate([GenRequest(i, x, 1) for i, x in enumerate(ids)], greedy)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    results = backend.generate([GenRequest(i, x, max_tokens) for i, x in enumerate(ids)], greedy)
    wall = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    return tokens / wall, ttft, tokens


async def _stream_one(client, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    first, tokens = None, 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first if first is not None else time.perf_counter() - start, tokens


def bench_server(endpoint, prompts: list[str], max_tokens: int) -> tuple[float, float, int]:
    """(tokens/s, median time to first token s, tokens) for len(prompts) concurrent streamed requests."""
    from stages.eval.serving import async_client

    async def go():
        client = async_client(endpoint)
        try:
            await _stream_one(client, endpoint.model, prompts[0], 2)  # warm-up
            start = time.perf_counter()
            done = await asyncio.gather(*[_stream_one(client, endpoint.model, p, max_tokens) for p in prompts])
            return time.perf_counter() - start, done
        finally:
            await client.close()

    wall, done = asyncio.run(go())
    tokens = sum(n for _, n in done)
    return tokens / wall, statistics.median(t for t, _ in done), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    import json

    import torch
    from transformers import AutoTokenizer

    from stages.bootstrap import bootstrap_model
    from stages.core.config.loader import load_config
    from stages.data import prepare_data
    from stages.eval.serving import serving

    torch.set_num_threads(1)
    config = load_config("tiny-cpu")
    cache_root = PROJECT_ROOT / ".cache"
    outputs = cache_root / "test-outputs"  # content-addressed: shares the tests' tiny model and data
    model = bootstrap_model(config.model, outputs, cache_root)
    data = prepare_data(config.data, outputs)
    questions = [json.loads(line)["question"] for line in Path(data.file("eval_test")).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    rows: dict[int, dict[str, tuple[float, float, int]]] = {c: {} for c in args.concurrency}
    for c in args.concurrency:
        rows[c]["transformers"] = bench_transformers(model.path, prompts_for(tokenizer, questions, c), args.max_tokens)
    started = time.perf_counter()
    with serving(config.serve, model, cache_root / "bench-outputs" / "logs") as endpoint:
        startup = time.perf_counter() - started
        for c in args.concurrency:
            rows[c]["vllm"] = bench_server(endpoint, prompts_for(tokenizer, questions, c), args.max_tokens)
    print(f"serving bench, tiny model fp32, greedy, up to {args.max_tokens} tokens per request; vLLM server "
          f"startup {startup:.0f} s (enforce_eager={config.serve.vllm.enforce_eager})")
    print(f"{'concurrency':>11} | {'transformers tok/s':>18} {'TTFT s':>7} | {'vLLM tok/s':>10} {'TTFT s':>7} | "
          f"{'tok/s ratio':>11} {'TTFT ratio':>10}")
    for c, cols in rows.items():
        (bt, bf, bn), (vt, vf, vn) = cols["transformers"], cols["vllm"]
        print(f"{c:>11} | {bt:>18.1f} {bf:>7.2f} | {vt:>10.1f} {vf:>7.2f} | {vt / bt:>10.2f}x {vf / bf:>9.2f}x"
              f"   (tokens {bn} / {vn})")
    ratios = {c: (cols["vllm"][0] / cols["transformers"][0], cols["vllm"][1] / cols["transformers"][1])
              for c, cols in rows.items()}
    each = range(len(ratios))
    write_result("eval", {"concurrency": list(ratios), "tok_s_x": [round(t, 2) for t, _ in ratios.values()],
                          "ttft_x": [round(f, 2) for _, f in ratios.values()], "vllm_startup_s": round(startup, 1)},
                 summary="at concurrency " + " / ".join(map(str, ratios)) + ": vLLM "
                         + " / ".join(f"{{tok_s_x[{i}]:.2f}}x" for i in each) + " the tokens/s; time to first token "
                         + " / ".join(f"{{ttft_x[{i}]:.2f}}x" for i in each),
                 what="serving: vLLM's server vs the transformers backend, tokens/s and time to first token",
                 command="bench/bench_eval.py", details="eval.md#throughput-benchbench_evalpy",
                 conditions={"max_tokens": args.max_tokens, "enforce_eager": config.serve.vllm.enforce_eager})


if __name__ == "__main__":
    main()
