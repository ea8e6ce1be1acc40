"""The sandbox's child side: the zygote server (`zygote_server.py`, `ZygoteServer`) and the per-call isolation
steps (`isolation.py`). Stdlib + ctypes only; zygote_client.py sends `isolation.py` then `zygote_server.py` as one
`python -c` program, so neither may import a project module when run that way."""
