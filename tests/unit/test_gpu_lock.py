"""The GPU install (docs/decisions.md "Install: the GPU lock"): requirements/verl-gpu.lock pins every requirement of
requirements/verl-gpu.txt at a version that satisfies it, with hashes, for the CUDA 13 stack the driver check
guards; the driver check stops with the fix; a GPU run that sees no GPU is refused instead of measuring RAM. The
slow test re-resolves the lock from the package registry for the GPU platform (no GPU needed), with the lock itself
as constraints, and compares: its answer does not move with the registry's newer releases."""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from stages.core.config.rl_engine import VerlSection
from stages.core.engine_spec import VERL_VERSION
from stages.core.env import PROJECT_ROOT
from stages.rl.verl import resources

REQ = PROJECT_ROOT / "requirements"
LOCK = REQ / "verl-gpu.lock"
CHECK_DRIVER = PROJECT_ROOT / "scripts" / "check-driver.sh"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
EXTRA_BRINGS = {("verl", "vllm"): "vllm", ("ray", "default"): "aiohttp-cors"}


def read_lock(path: Path) -> dict[str, tuple[str, frozenset[str]]]:
    """{canonical name: (version, sha256 hashes)} of a `uv pip compile --generate-hashes` file."""
    pins: dict[str, tuple[str, frozenset[str]]] = {}
    name = None
    for line in path.read_text().splitlines():
        if match := PIN.match(line):
            name = canonicalize_name(match.group(1))
            pins[name] = (match.group(2), frozenset())
        if name and (hashes := HASH.findall(line)):
            pins[name] = (pins[name][0], pins[name][1] | set(hashes))
    return pins


def top_level(path: Path) -> list[Requirement]:
    """The requirements of a pip requirements file, following `-r` includes."""
    out: list[Requirement] = []
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-r"):
            out += top_level(path.parent / line[2:].strip())
        else:
            out.append(Requirement(line))
    return out


def test_the_lock_pins_every_requirement_with_hashes():
    pins = read_lock(LOCK)
    assert len(pins) > 200  # verl[vllm]'s closure: ~270 distributions
    for req in top_level(REQ / "verl-gpu.txt"):
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is not in {LOCK.name}: rerun ./scripts/lock-verl-gpu.sh"
        assert req.specifier.contains(pins[name][0], prereleases=True), \
            f"{LOCK.name} pins {name}=={pins[name][0]}, which {req} excludes: rerun ./scripts/lock-verl-gpu.sh"
        for extra in req.extras:  # one distribution only the extra brings (verl's and ray's wheel metadata)
            assert EXTRA_BRINGS[(name, extra)] in pins, f"{req}: the [{extra}] extra is not in {LOCK.name}"
    unhashed = sorted(name for name, (_, hashes) in pins.items() if not hashes)
    assert not unhashed, f"pins without a hash (pip --require-hashes refuses them): {unhashed}"


def test_the_lock_is_the_cuda_13_stack_the_driver_check_guards():
    """The facts scripts/check-driver.sh and the docs state: torch 2.11.0 (requires cuda-toolkit==13.0.2 in its
    wheel metadata), vLLM 0.24.0 (requires torch==2.11.0), CUDA 13 libraries only (no cu12 wheel beside them), so
    driver >= 580 (CUDA 13.x's minimum driver branch)."""
    pins = {name: version for name, (version, _) in read_lock(LOCK).items()}
    assert (pins["torch"], pins["vllm"], pins["verl"], pins["transformers"]) == ("2.11.0", "0.24.0", VERL_VERSION, "5.9.0")
    assert pins["cuda-toolkit"].split(".")[0] == "13" and pins["nvidia-cuda-runtime"].split(".")[0] == "13"
    assert not [name for name in pins if name.endswith("-cu12")]
    assert "flash-attn" not in pins  # sdist-only on PyPI: the attention route is sdpa (docs/decisions.md)
    assert "MIN_DRIVER=580" in CHECK_DRIVER.read_text()
    # the compile command the lock's header names is the script that regenerates it
    assert "./scripts/lock-verl-gpu.sh" in LOCK.read_text()[:300]
    assert (PROJECT_ROOT / "scripts" / "lock-verl-gpu.sh").stat().st_mode & stat.S_IXUSR


def _driver_check(tmp_path: Path, smi: str | None) -> subprocess.CompletedProcess:
    """scripts/check-driver.sh with a fake nvidia-smi (None: none on PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if smi is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\n{smi}\n")
        fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "ARPO_SKIP_DRIVER_CHECK"} | {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    return subprocess.run(["bash", str(CHECK_DRIVER)], env=env, capture_output=True, text=True, timeout=30)


def test_the_driver_check_stops_with_the_fix(tmp_path):
    ok = _driver_check(tmp_path, "echo 580.95.05; echo 580.95.05")   # one line per GPU
    assert ok.returncode == 0 and "580.95.05" in ok.stdout, ok.stderr
    assert _driver_check(tmp_path, "echo 590.44.01").returncode == 0
    old = _driver_check(tmp_path, "echo 550.163.01")
    assert old.returncode == 1 and "550.163.01 is too old" in old.stderr and "Fix: install NVIDIA driver 580" in old.stderr
    broken = _driver_check(tmp_path, "echo \"NVIDIA-SMI has failed because it couldn't communicate\"; exit 9")
    assert broken.returncode == 1 and "nvidia-smi failed" in broken.stderr and "Fix:" in broken.stderr
    (tmp_path / "bin" / "nvidia-smi").unlink()
    if not any(Path(d, "nvidia-smi").exists() for d in ("/usr/bin", "/bin")):
        missing = _driver_check(tmp_path, None)
        assert missing.returncode == 1 and "nvidia-smi not found" in missing.stderr and "Fix:" in missing.stderr
    skipped = subprocess.run(["bash", str(CHECK_DRIVER)], env={**os.environ, "ARPO_SKIP_DRIVER_CHECK": "1",
                                                               "PATH": "/usr/bin:/bin"}, capture_output=True)
    assert skipped.returncode == 0


def test_a_gpu_run_without_a_visible_gpu_is_refused_not_measured_in_ram():
    """verl's trainer.device decides (default cuda, verl/trainer/config/ppo_trainer.yaml:229): a GPU run whose probe
    finds no GPU stops with the fix; a CPU run (trainer.device=cpu, the smoke run's override) measures RAM."""
    assert resources.verl_device(VerlSection()) == "cuda"
    assert resources.verl_device(VerlSection(extra_overrides=["trainer.device=cpu"])) == "cpu"
    assert resources.verl_device(VerlSection(extra_overrides=["trainer.device=cpu", "+trainer.device='cuda'"])) \
        == "cuda"  # the last override wins, as in Hydra
    cpu_torch = [sys.executable, "-c", "print('{\"kind\": \"cpu\", \"torch\": \"2.11.0+cpu\", \"cuda\": null}')"]
    with pytest.raises(resources.VerlResourceError, match=r"(?s)sees no GPU.*CPU build.*Fix:.*rl\.verl\.cpu_mode: true"):
        resources.device_memory(cpu_torch, device="cuda")
    hidden = [sys.executable, "-c", "print('{\"kind\": \"cpu\", \"torch\": \"2.11.0\", \"cuda\": \"13.0\"}')"]
    with pytest.raises(resources.VerlResourceError, match=r"(?s)is_available\(\) is False.*driver >= 580"):
        resources.device_memory(hidden, device="cuda")
    kind, total, available = resources.device_memory(cpu_torch, device="cpu")
    assert kind == "cpu" and total >= available > 0


def _registry_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.registry
def test_the_lock_resolves_again_for_the_gpu_platform(tmp_path):
    """~5 s (uv, registry metadata only; ~30 s more the first time, to install uv into /tmp/arpo-uv): the script's
    `--verify`, `uv pip compile` of requirements/verl-gpu.txt for Linux x86_64 / Python 3.11 with the committed lock
    as constraints, gives the lock's pins and hashes again. Hermetic to the registry's growth: a newer release cannot
    change the answer (the constraints pin every name), only a changed requirements file or a locked release that
    left the registry can (what is newer: `./scripts/lock-verl-gpu.sh --check`, opt-in). Needs the package registry,
    as the install does; CI, which installed from it, fails rather than skips without it."""
    if not _registry_reachable():
        if os.environ.get("CI"):
            pytest.fail("the package registry is unreachable, and this CI run installed from it: check the network")
        pytest.skip("no network to the package registry: the lock is re-resolved from it (run with -m 'not registry')")
    out = tmp_path / "verl-gpu.lock"
    proc = subprocess.run([str(PROJECT_ROOT / "scripts" / "lock-verl-gpu.sh"), "--verify", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\nrequirements/verl-gpu.txt asks for something the lock " \
                                 "does not pin, or a locked release left the registry: run ./scripts/lock-verl-gpu.sh"
    fresh, committed = read_lock(out), read_lock(LOCK)
    changed = {name: (committed.get(name, ("-",))[0], fresh.get(name, ("-",))[0])
               for name in set(fresh) | set(committed) if fresh.get(name) != committed.get(name)}
    assert not changed, f"{LOCK.name} is stale ((committed, fresh) per name; the same version means its files' " \
                        f"hashes changed): {changed}; run ./scripts/lock-verl-gpu.sh"
