"""The python sandbox: run model-written code in an isolated, resource-limited process.

Host (parent) side, imported by the pipeline:
- `executor.py`: `PythonSandbox(cfg).run(code) -> ExecResult`, the API; the isolation mode (bwrap | rlimit).
- `zygote_client.py`: `WarmParent` / `ZygoteClient`, which start the warm zygote process and hand it calls.
- `spec.py`: pure parts (code preparation, the bubblewrap command line, the environment, output shaping).
- `host.py`: process-level helpers (interpreter discovery, per-call uids, sweeping leftovers, capped reads).

Child side (`child/`), what runs inside the isolated process: its files' source is sent as one `python -c`
program, so the sandbox sees no project file. Stdlib only; nothing here imports a config model, so the
host-side modules above except `executor.py` run under any python (a test drives them as an ordinary user).
"""
