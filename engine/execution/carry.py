"""Input tokens a step takes from the device instead of the host (`Carry`): in an overlapped step
a decoding request's input is the token the step before sampled, which the host has not read yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Carry:
    """Token ids of the flattened step's positions `rows` [n] (int64, on the device), taken from
    `tokens` [n] (int64, on the device: the previous step's samples, gathered in row order)."""

    rows: torch.Tensor
    tokens: torch.Tensor

    def apply(self, ids: torch.Tensor) -> None:
        """Write the carried tokens into a step's input ids [num_tokens] on the device (one
        launch, queued after whatever wrote `ids` and `tokens`)."""
        ids.index_copy_(0, self.rows, self.tokens)
