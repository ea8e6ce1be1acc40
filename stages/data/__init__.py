"""Task data: the seeded synthetic tool-use task set, and readers/validators for the real RL parquet."""

from stages.data.prepare import prepare_data
from stages.data.rl_parquet import DatasetRowError, RLRow, read_rl_parquet

__all__ = ["DatasetRowError", "RLRow", "prepare_data", "read_rl_parquet"]
