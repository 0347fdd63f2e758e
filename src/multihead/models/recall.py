"""Multi-query associative recall (MQAR), generated on the fly.

A sequence lists ``N`` key-value pairs, then asks for ``M`` of the keys again; after each asked
key the model must produce the value that key was paired with::

    k3 v7  k0 v2  k5 v7  k1 v4 | k0 v2  k1 v4  k3 v7      (N = 4 pairs, M = 3 queries)
    ------------ pairs --------  ------- queries --------
                                  ^ predict v2 here: find k0 among the pairs, read the value after it

This is the "look up the value whose key matches" picture of attention: a head at the query
position attends to the pair whose key equals the query. Keys are distinct within a sequence;
values may repeat. Token ids: keys ``[0, num_keys)``, values ``[num_keys, num_keys + num_values)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["RecallTask", "IGNORE_INDEX"]

#: Target for positions that are not scored (``F.cross_entropy``'s default ``ignore_index``).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class RecallTask:
    """Sizes of the task. ``seq_len = 2 * (num_pairs + num_queries)`` tokens per sequence."""

    num_pairs: int = 8
    num_queries: int = 8
    num_keys: int = 32  # key vocabulary; num_pairs distinct keys are drawn per sequence
    num_values: int = 32

    def __post_init__(self):
        for name in ("num_pairs", "num_queries", "num_keys", "num_values"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RecallTask: {name} must be a positive int, got {value!r}")
        if self.num_pairs > self.num_keys:
            raise ValueError(
                f"RecallTask: num_pairs={self.num_pairs} distinct keys need num_keys >= num_pairs, "
                f"got num_keys={self.num_keys}"
            )
        if self.num_queries > self.num_pairs:
            raise ValueError(
                f"RecallTask: num_queries={self.num_queries} must be <= num_pairs={self.num_pairs} "
                "(each pair is asked at most once)"
            )

    @property
    def vocab_size(self) -> int:
        """Keys and values: the tokens a sequence is made of."""
        return self.num_keys + self.num_values

    @property
    def seq_len(self) -> int:
        """Tokens per sequence: the pairs, then the queries with their answers."""
        return 2 * (self.num_pairs + self.num_queries)

    @property
    def prompt_len(self) -> int:
        """Tokens before the first query: the pairs."""
        return 2 * self.num_pairs

    def sample(self, batch: int, generator: torch.Generator | None = None) -> Tensor:
        """``(batch, seq_len)`` token ids: pairs, then (query key, its value) pairs."""
        N, M = self.num_pairs, self.num_queries
        # Distinct keys per row: the first N of a random permutation of the key vocabulary.
        keys = torch.rand(batch, self.num_keys, generator=generator).argsort(dim=1)[:, :N]  # (B, N)
        values = self.num_keys + torch.randint(self.num_values, (batch, N), generator=generator)  # (B, N)
        asked = torch.rand(batch, N, generator=generator).argsort(dim=1)[:, :M]  # (B, M) pair indices
        seq = torch.empty(batch, self.seq_len, dtype=torch.long)
        seq[:, 0 : 2 * N : 2], seq[:, 1 : 2 * N : 2] = keys, values
        seq[:, 2 * N :: 2] = keys.gather(1, asked)
        seq[:, 2 * N + 1 :: 2] = values.gather(1, asked)
        return seq

    def inputs_and_targets(self, seq: Tensor) -> tuple[Tensor, Tensor]:
        """Next-token inputs ``seq[:, :-1]`` and targets ``(B, seq_len - 1)`` that score only the
        answers (the value after each query key); every other target is :data:`IGNORE_INDEX`."""
        inputs, targets = seq[:, :-1], seq[:, 1:].clone()
        scored = self.answer_positions(seq.device)  # positions of the query keys in `inputs`
        keep = torch.zeros(targets.shape[1], dtype=torch.bool, device=seq.device)
        keep[scored] = True
        targets[:, ~keep] = IGNORE_INDEX
        return inputs, targets

    def answer_positions(self, device=None) -> Tensor:
        """Input positions ``(M,)`` holding the query keys; the model's output there is the answer."""
        return torch.arange(2 * self.num_pairs, self.seq_len, 2, device=device)

    def source_positions(self, seq: Tensor) -> Tensor:
        """``(B, M)``: for each query, the position of the *value* of the matching pair (where a
        lookup head should look)."""
        N = self.num_pairs
        keys = seq[:, 0 : 2 * N : 2]  # (B, N)
        queries = seq[:, 2 * N :: 2]  # (B, M)
        pair = (queries.unsqueeze(-1) == keys.unsqueeze(1)).float().argmax(-1)  # (B, M)
        return 2 * pair + 1

    def describe(self) -> str:
        """The task in one line."""
        return (
            f"{self.num_pairs} key-value pairs, {self.num_queries} queries, {self.num_keys} keys x "
            f"{self.num_values} values, {self.seq_len} tokens"
        )

    def token_names(self, seq: Tensor) -> list[str]:
        """Readable tokens of one sequence ``(seq_len,)``: ``k3``, ``v7``."""
        return [f"k{t}" if t < self.num_keys else f"v{t - self.num_keys}" for t in seq.tolist()]
