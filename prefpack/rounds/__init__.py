"""On-policy rounds (``prefpack train`` with a ``rounds`` section): each round samples the current policy, scores the
samples, writes the round's pair store and trains on it (docs/on-policy.md)."""

from prefpack.rounds.driver import RoundsInterrupted, RoundsResult, run_rounds

__all__ = ["RoundsInterrupted", "RoundsResult", "run_rounds"]
