"""Peak host memory of the verl FSDP merge stage, before (in memory) vs after (streamed), on CPU.

Builds a random-init Llama (default ~106M parameters, 423 MB in float32; embedding + lm_head 16% of it, Qwen3-14B's
are 11%, so the largest tensor weighs about as much as at 14B), writes it the way verl does (DTensor
shards of world size 2 written by 2 gloo processes: 2-D tensors Shard(0), 1-D Replicate, as in
tests/integration/test_rl_merge_fsdp.py), then runs each merge to bfloat16 in a fresh process and prints the
child's peak RSS (getrusage ru_maxrss), the peak after the folder is written (before the parity checks), and the
ratios against the baseline measured in the same run:

- before: the algorithm until this change: every rank file loaded whole, one assembled state dict, a float32 model
  saved as the `verl_assembled` folder (`write_in_memory`), then merged as an `hf` checkpoint (reference probe
  model, float32 model rounded and saved, the folder loaded back);
- after: `merge_checkpoint` on the verl checkpoint as the stage runs it now (`_merge_verl`), with the output shard
  and re-open bounds scaled to this model as the defaults (2 GiB / 1 GiB) are to a 14B one (`--shard-mb`,
  `--group-mb`), and once more with the defaults themselves (at this size: the whole model in one shard).

    .venv/bin/python bench/bench_merge_memory.py [--hidden 1024 --layers 8 --vocab 8192 --shard-mb 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import write_result  # noqa: E402

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from stages.core.config.merge import MergeSection
from stages.core.refs import CheckpointRef
from stages.rl import fsdp_merge, merge_weights
from stages.rl.shard_writer import partial_folder
import safetensors.torch, transformers.models.llama.modeling_llama  # what the merges import lazily: not theirs
from transformers import AutoModelForCausalLM, AutoTokenizer

mode, actor, out, shard_mb, group_mb = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), *map(float, sys.argv[4:6])
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
imports, start, marks = peak(), time.time(), {}
cfg = MergeSection(dtype="bfloat16")
if mode == "before":
    with partial_folder(out / "verl_assembled") as tmp:  # the float32 folder the stage wrote until this change
        fsdp_merge.write_merged_folder(actor, tmp, dtype=torch.float32, in_memory=True)
    marks["written"] = peak()
    ckpt = CheckpointRef(path=str(out / "verl_assembled"), fingerprint="bench", format="hf")
else:
    fsdp_merge.MAX_SHARD_BYTES, fsdp_merge.GROUP_BYTES = int(shard_mb * 2**20), int(group_mb * 2**20)
    write = merge_weights.write_merged_folder
    def timed_write(*args, **kwargs):
        entries = write(*args, **kwargs)
        marks["written"] = peak()
        return entries
    merge_weights.write_merged_folder = timed_write
    ckpt = CheckpointRef(path=str(actor), fingerprint="bench", format="verl_fsdp")
report = merge_weights.merge_to_folder(cfg, ckpt, out / "model")
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"imports": imports, "written": marks["written"], "peak": peak(), "hwm": hwm,
                  "seconds": time.time() - start,
                  "merge_diff": report["merge_diff"],
                  "files": len(list((out / "model").glob("*.safetensors")))}))
"""


def _write_rank(rank: int, world: int, weights: str, actor: str, init_file: str) -> None:
    """One rank of a verl-like save: every tensor distributed over a 1-D ("fsdp",) mesh, then torch.save."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    state = load_file(weights)
    sharded = {k: distribute_tensor(v, mesh, [Replicate() if v.dim() == 1 else Shard(0)]) for k, v in state.items()}
    torch.save(sharded, Path(actor) / f"model_world_size_{world}_rank_{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def build_checkpoint(root: Path, args: argparse.Namespace) -> tuple[Path, int]:
    """global_step_1/actor with 2 DTensor rank files and huggingface/ (config, tokenizer); returns the actor folder
    and the model's float32 bytes."""
    import torch
    import torch.multiprocessing as mp
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.verl.fsdp_fixture import tiny_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    actor = root / "global_step_1" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    config.save_pretrained(actor / "huggingface")
    tiny_tokenizer().save_pretrained(actor / "huggingface")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    save_file(state, str(root / "original.safetensors"))
    del model, state
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_write_rank, args=(2, str(root / "original.safetensors"), str(actor), str(root / "pg_init")), nprocs=2)
    (root / "original.safetensors").unlink()
    return actor, nbytes


def run_build(root: Path, args: argparse.Namespace) -> tuple[Path, int]:
    """Build the checkpoint in its own process: a child's ru_maxrss starts from its parent's resident set (Linux
    keeps the high-water mark across fork and exec), so this process must never hold a model."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "build"]
    proc = subprocess.run([sys.executable, __file__, f"--build={root}", *flags], cwd=ROOT, capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"building the checkpoint failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return Path(out["actor"]), out["nbytes"]


def run_child(mode: str, actor: Path, out: Path, shard_mb: float, group_mb: float) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(actor), str(out), str(shard_mb), str(group_mb)],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} merge failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--shard-mb", type=float, default=16.0, help="output shard bound of the scaled run")
    parser.add_argument("--group-mb", type=float, default=8.0, help="re-open bound of the scaled run")
    parser.add_argument("--build", default="", help=argparse.SUPPRESS)  # internal: the build child
    args = parser.parse_args()
    if args.build:
        actor, nbytes = build_checkpoint(Path(args.build), args)
        print(json.dumps({"actor": str(actor), "nbytes": nbytes}))
        return
    with tempfile.TemporaryDirectory(prefix="bench_merge_") as tmp:
        actor, nbytes = run_build(Path(tmp), args)
        runs = [("before (in memory)", "before", 0, 0),
                (f"after, streamed ({args.shard_mb:g} MB shards, {args.group_mb:g} MB re-open)", "after",
                 args.shard_mb, args.group_mb),
                ("after, streamed (stage defaults 2048 / 1024 MB)", "after", 2048, 1024)]
        results = []
        for i, (label, mode, shard_mb, group_mb) in enumerate(runs):
            results.append((label, run_child(mode, actor, Path(tmp) / f"out{i}", shard_mb, group_mb)))
    mib = 2**20
    base = results[0][1]
    print(f"model: {nbytes / mib:,.0f} MiB in float32 ({nbytes // 4 / 1e6:.1f}M parameters), merged to bfloat16, "
          "peaks are the child's ru_maxrss")
    print("| merge | peak RSS MiB (VmHWM) | above imports MiB | in float32 model copies | until written MiB |"
          " peak / before | peak above imports / before | s | files |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, r in results:
        above = r["peak"] - r["imports"]
        print(f"| {label} | {r['peak'] / mib:,.0f} ({r['hwm'] / mib:,.0f}) | {above / mib:,.0f} | {above / nbytes:.2f} | "
              f"{(r['written'] - r['imports']) / mib:,.0f} | {r['peak'] / base['peak']:.2f}x | "
              f"{above / (base['peak'] - base['imports']):.2f}x | {r['seconds']:.1f} | {r['files']} |", flush=True)
    after = results[1][1]
    write_result("merge_memory",
                 {"above_imports_x": round((after["peak"] - after["imports"]) / (base["peak"] - base["imports"]), 3),
                  "after_fp32_copies": round((after["peak"] - after["imports"]) / nbytes, 3),
                  "before_fp32_copies": round((base["peak"] - base["imports"]) / nbytes, 3),
                  "peak_x": round(after["peak"] / base["peak"], 3), "params_m": round(nbytes / 4 / 1e6, 1),
                  "by_run": {label: {k: r[k] for k in ("peak", "hwm", "imports", "written", "seconds", "files")}
                             for label, r in results}},
                 summary="streamed {above_imports_x:.2f}x the memory above imports of the in-memory merge "
                         "({after_fp32_copies:.2f} vs {before_fp32_copies:.2f} float32 model copies; {peak_x:.2f}x the "
                         "whole RSS), no float32 folder on disk",
                 what="peak host memory of the verl FSDP merge: streamed vs the in-memory assembly it replaced (a "
                      "random-init Llama as 2-rank DTensor shards, merged to bfloat16, each in a fresh process)",
                 command="bench/bench_merge_memory.py", details="rl.md#merge-stagesrlmergepy-stagesrlfsdp_mergepy",
                 conditions={k: v for k, v in vars(args).items() if k != "build"})


if __name__ == "__main__":
    main()
