"""The compression knob every policy that ranks tokens takes: ``budget`` (tokens kept) or
``compression_ratio`` (the share of the prompt removed, kvpress's meaning), one of the two."""

from __future__ import annotations

__all__ = ["check_budget", "kept_of"]


def check_budget(owner: str, budget: object, compression_ratio: object) -> None:
    """Exactly one of ``budget`` (an int ``>= 1``) and ``compression_ratio`` (a float in ``[0, 1)``)."""
    if (budget is None) == (compression_ratio is None):
        raise ValueError(
            f"{owner}: pass exactly one of budget (tokens kept) and compression_ratio (share of the prompt "
            f"removed), got budget={budget!r}, compression_ratio={compression_ratio!r}"
        )
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"{owner}: budget must be an int >= 1 (tokens kept), got {budget!r}")
    if compression_ratio is not None and (
        isinstance(compression_ratio, bool)
        or not isinstance(compression_ratio, (int, float))
        or not 0 <= compression_ratio < 1
    ):
        raise ValueError(
            f"{owner}: compression_ratio must be a float in [0, 1), the share of the prompt removed "
            f"(0.75 keeps a quarter), got {compression_ratio!r}"
        )


def kept_of(prompt: int, budget: int | None, compression_ratio: float | None) -> int:
    """Tokens kept of a ``prompt``: the budget, or ``int(prompt · (1 - ratio))`` (kvpress), at least 1."""
    if budget is not None:
        return budget
    assert compression_ratio is not None  # check_budget: one of the two
    return max(1, int(prompt * (1 - compression_ratio)))
