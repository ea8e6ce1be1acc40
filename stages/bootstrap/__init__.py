"""Model bootstrap: turn the configured source (PyPI GGUF wheel, hub id, local folder) into an HF folder."""

from stages.bootstrap.model import ModelNotAvailableError, bootstrap_model

__all__ = ["ModelNotAvailableError", "bootstrap_model"]
