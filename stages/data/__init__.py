"""Task data: the seeded synthetic tool-use task set (prepare_data). The RL parquet schema that every stage reads
is stages.core.rl_parquet (shared, so that reading the data does not make the data stage part of another's key)."""

from stages.data.prepare import prepare_data

__all__ = ["prepare_data"]
