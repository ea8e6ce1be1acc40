"""An OpenAI-compatible server over `transformers` generation with request batching (the `cpu` backend).

    python -m stages.eval.cpu_server --model <hf folder> --port 0 --port-file port.txt

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /stats.
Concurrent requests wait in one queue; a worker takes up to `--max-batch-size` sequences (a request with
`n=k` is k sequences) and runs them in one `generate` call (stages.eval.cpu_engine), reusing the KV cache
of recently seen prompt prefixes (stages.eval.prefix_cache). /stats reports the batch sizes it ran and
the prefix reuse. Semantics follow vLLM's OpenAI server: stop strings are cut from the text with
finish_reason "stop" and the matched string in `stop_reason`; `n`, `seed`, log-probs (completions
`logprobs: int`, chat `logprobs` + `top_logprobs`) and the vLLM extras `top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `include_stop_str_in_output` are honoured. `transformers serve`
does none of this (research/feasibility.md section 4), hence this server.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
import uuid
from collections import Counter
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from stages.core.log import get_logger
from stages.eval.cpu_engine import Engine, Row, RowResult, SamplingParams

log = get_logger("stages.eval.cpu_server")


class OpenAIError(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class Batcher:
    """One queue of rows; a worker runs up to `max_batch_size` of them per `generate` call."""

    def __init__(self, engine: Engine, max_batch_size: int, wait_s: float) -> None:
        self.engine, self.max_batch_size, self.wait_s = engine, max_batch_size, wait_s
        self.queue: asyncio.Queue[tuple[Row, asyncio.Future[RowResult]]] = asyncio.Queue()
        self.batch_sizes: Counter[int] = Counter()
        self.requests = 0
        self.generated_tokens = 0
        self.busy_s = 0.0

    async def submit(self, rows: list[Row]) -> list[RowResult]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in rows]
        self.requests += 1
        for row, future in zip(rows, futures):
            self.queue.put_nowait((row, future))
        return list(await asyncio.gather(*futures))

    async def _collect(self) -> list[tuple[Row, asyncio.Future[RowResult]]]:
        batch = [await self.queue.get()]
        deadline = time.monotonic() + self.wait_s
        while len(batch) < self.max_batch_size:
            remaining = deadline - time.monotonic()
            try:
                batch.append(self.queue.get_nowait() if remaining <= 0 else
                             await asyncio.wait_for(self.queue.get(), remaining))
            except (TimeoutError, asyncio.QueueEmpty):
                break
        return batch

    async def run(self) -> None:
        while True:
            batch = [(row, fut) for row, fut in await self._collect() if not fut.cancelled()]
            if not batch:
                continue
            start = time.monotonic()
            try:
                results = await asyncio.to_thread(self.engine.generate, [row for row, _ in batch])
            except Exception as err:  # noqa: BLE001 -- a failed batch fails its requests, not the server
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            finally:
                self.busy_s += time.monotonic() - start
            self.batch_sizes[len(batch)] += 1
            for (_, fut), result in zip(batch, results):
                self.generated_tokens += len(result.token_ids)
                if not fut.done():
                    fut.set_result(result)

    def stats(self) -> dict[str, Any]:
        sizes = self.batch_sizes
        return {"requests": self.requests, "batches": sum(sizes.values()),
                "sequences": sum(k * v for k, v in sizes.items()),
                "batch_size_histogram": {str(k): v for k, v in sorted(sizes.items())},
                "max_batch_size_seen": max(sizes, default=0), "max_batch_size": self.max_batch_size,
                "generated_tokens": self.generated_tokens, "busy_s": round(self.busy_s, 3),
                "queued": self.queue.qsize(), **self.engine.prefix.stats()}


def sampling_params(req: _Common, max_tokens: int, logprobs: int | None, seed: int | None) -> SamplingParams:
    if req.stream:
        raise OpenAIError("stream=true is not supported by this server; send stream=false")
    if req.presence_penalty or req.frequency_penalty:
        raise OpenAIError("presence_penalty/frequency_penalty are not supported; use repetition_penalty")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                              top_k=max(req.top_k, 0), min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                              stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()), seed=seed,
                              logprobs=logprobs, include_stop_str_in_output=req.include_stop_str_in_output)
    except ValueError as err:
        raise OpenAIError(str(err)) from err


def budget(engine: Engine, prompt_len: int, requested: int | None) -> int:
    """max_tokens clamped to the context left after the prompt (an over-long prompt is an error)."""
    room = engine.max_model_len - prompt_len
    if room <= 0:
        raise OpenAIError(f"the prompt is {prompt_len} tokens; this model's maximum context length is "
                          f"{engine.max_model_len}. Shorten the prompt.")
    if requested is not None and requested < 1:
        raise OpenAIError("max_tokens must be >= 1")
    return min(requested or room, room)


def make_rows(prompt_ids: list[int], req: _Common, max_tokens: int, logprobs: int | None) -> list[Row]:
    """`n` rows of one prompt; with a seed, sample j uses seed + j (reproducible, yet distinct)."""
    return [Row(list(prompt_ids), sampling_params(req, max_tokens, logprobs,
                                                  None if req.seed is None else req.seed + j))
            for j in range(req.n)]


def completion_logprobs(result: RowResult) -> dict[str, Any] | None:
    if result.logprobs is None:
        return None
    return {"tokens": [e.token for e in result.logprobs], "token_logprobs": [e.logprob for e in result.logprobs],
            "top_logprobs": [dict(e.top) for e in result.logprobs], "text_offset": result.text_offsets}


def chat_logprobs(result: RowResult) -> dict[str, Any] | None:
    if result.logprobs is None:
        return None

    def item(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in result.logprobs]}


def usage(prompt_tokens: int, results: list[RowResult]) -> dict[str, int]:
    completion = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def completion_prompts(engine: Engine, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [engine.encode(prompt)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [engine.encode(p) if isinstance(p, str) else list(p) for p in prompt]


class Service:
    """The OpenAI endpoints' logic over one engine and its batcher."""

    def __init__(self, engine: Engine, batcher: Batcher, served_name: str, model_path: str) -> None:
        self.engine, self.batcher, self.served_name, self.model_path = engine, batcher, served_name, model_path

    def check_model(self, name: str) -> None:
        if name != self.served_name:
            raise OpenAIError(f"the model {name!r} does not exist; this server serves {self.served_name!r}", 404,
                              "NotFoundError")

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.served_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "arpo-pipeline", "root": self.model_path,
                                            "max_model_len": self.engine.max_model_len}]}

    async def completions(self, req: CompletionRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if req.echo or (req.best_of or req.n) != req.n:
            raise OpenAIError("echo and best_of != n are not supported")
        prompts = completion_prompts(self.engine, req.prompt)
        rows = [row for ids in prompts
                for row in make_rows(ids, req, budget(self.engine, len(ids), req.max_tokens), req.logprobs)]
        results = await self.batcher.submit(rows)
        choices = [{"index": i, "text": r.text, "logprobs": completion_logprobs(r), "finish_reason": r.finish_reason,
                    "stop_reason": r.stop_reason} for i, r in enumerate(results)]
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.served_name, "choices": choices, "usage": usage(sum(map(len, prompts)), results)}

    async def chat(self, req: ChatRequest) -> dict[str, Any]:
        self.check_model(req.model)
        ids = self.engine.chat_prompt(req.messages)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = budget(self.engine, len(ids), req.max_completion_tokens or req.max_tokens)
        results = await self.batcher.submit(make_rows(ids, req, max_tokens, logprobs))
        choices = [{"index": i, "message": {"role": "assistant", "content": r.text}, "logprobs": chat_logprobs(r),
                    "finish_reason": r.finish_reason, "stop_reason": r.stop_reason} for i, r in enumerate(results)]
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.served_name, "choices": choices, "usage": usage(len(ids), results)}


def create_app(engine: Engine, served_name: str, max_batch_size: int = 8, batch_wait_s: float = 0.02,
               model_path: str = "") -> FastAPI:
    service = Service(engine, Batcher(engine, max_batch_size, batch_wait_s), served_name, model_path)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker = asyncio.create_task(service.batcher.run())
        yield
        worker.cancel()

    app = FastAPI(title="arpo-pipeline cpu server", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, err: OpenAIError) -> JSONResponse:
        return JSONResponse({"error": {"message": str(err), "type": err.kind, "code": err.status}}, err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return await _openai_error(request, OpenAIError(f"invalid request: {err.errors()}"))

    app.get("/health")(lambda: {"status": "ok"})
    app.get("/stats")(service.batcher.stats)
    app.get("/v1/models")(service.models)
    app.post("/v1/completions")(service.completions)
    app.post("/v1/chat/completions")(service.chat)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stages.eval.cpu_server", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model folder")
    parser.add_argument("--served-name", default=None, help="model name clients send (default: folder name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = a free port (written to --port-file)")
    parser.add_argument("--port-file", default=None, help="write the bound port here once listening")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--batch-wait-ms", type=float, default=20.0, help="wait for more requests to batch")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: free cores)")
    parser.add_argument("--prefix-cache-entries", type=int, default=8,
                        help="prompt prefixes whose KV cache is kept for reuse (0 = off)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import torch
    import uvicorn

    from stages.core.atomic import write_text
    from stages.core.env import free_cpu_threads

    args = parse_args(argv)
    torch.set_num_threads(args.threads or free_cpu_threads())
    engine = Engine.load(args.model, dtype=args.dtype, prefix_cache_entries=args.prefix_cache_entries)
    served = args.served_name or Path(args.model).name
    app = create_app(engine, served, args.max_batch_size, args.batch_wait_ms / 1000, str(args.model))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    if args.port_file:
        write_text(args.port_file, f"{port}\n")
    log.info("serving %s from %s on http://%s:%d/v1 (max batch %d)", served, args.model, args.host, port,
             args.max_batch_size)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=30))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
