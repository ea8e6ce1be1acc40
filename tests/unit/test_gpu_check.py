"""scripts/gpu_check.py (docs/gpu-check.md) runs end to end on CPU at tiny sizes: the local engine's ARPO step,
the memory measurement against the model, and the chunked-entropy check, with the JSON result a user sends back.

Tiny sizes, the real 151,936-token vocabulary: 1 layer, width 32 (about 10M parameters, almost all embedding and
LM head), 2 rows x (16 + 64) tokens; the entropy check takes 260 positions, so the chunked formula runs two chunks
(256 + 4 positions, stages/rl/logprobs.py CHUNK) against the unchunked one."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--threads", "1", "--layers", "1", "--hidden", "32", "--intermediate", "64",
        "--heads", "4", "--kv-heads", "2", "--rows", "2", "--micro-batch", "1", "--prompt", "16",
        "--response", "64", "--check-tokens", "260"]


def test_gpu_check_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), *TINY, "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "entropy chunking" in proc.stdout and "measured / predicted" in proc.stdout
    result = json.loads(out.read_text())
    assert result["ok"] is True
    shape = result["shape"]
    assert shape["vocab"] == 151936 and shape["response"] == 64 and shape["dtype"] == "bfloat16"
    # params: embedding + LM head 2 x 151,936 x 32 = 9,723,904; one layer: q 32x32+32, k/v 2 x (32x16+16),
    # o 32x32, MLP 3 x 32x64, 2 norms of 32 = 1,056 + 1,056 + 1,024 + 6,144 + 64 = 9,344; final norm 32
    assert shape["params"] == 9_723_904 + 9_344 + 32
    assert len(result["steps"]) == 2
    for step in result["steps"]:
        assert math.isfinite(step["loss"]) and step["grad_norm"] > 0 and step["optimizer_steps"] == 1.0
    mem = result["memory"]
    assert mem["measure"].startswith("VmHWM") and mem["ratio_of"] == "transient_bytes"
    assert mem["peak_bytes"] >= mem["before_bytes"] > 0
    # resident before the measured step: 16 bytes per parameter (fp32 weights, gradients, two AdamW moments)
    assert mem["predicted_before_bytes"] == 16 * shape["params"]
    assert set(mem["predicted_phases"]) == {"old_log_prob", "update_backward", "optimizer_step"}
    assert mem["predicted_peak_bytes"] == max(sum(p.values()) for p in mem["predicted_phases"].values())
    assert mem["ratio"] > 0 and mem["within_band"] is None      # the band is judged on CUDA only
    check = result["entropy_check"]
    assert check["ok"] is True and check["tokens"] == 260 and check["chunk_positions"] == 256
    assert all(check["max_abs_diff"][k] <= check["tolerance"][k] for k in ("logp", "entropy", "grad"))

