"""Rows and batches, the two conventions every layer shares: the label that trains nothing
(`IGNORE_INDEX`), and how one optimizer step's global batch splits over the workers (`BatchPlan`).
They live at the ground floor so the config, the data stream and the loop read one definition.

The optimizer sees G rows per step at every world size W. Rank r takes the slots
[r*G//W, (r+1)*G//W) of each step (floor or ceil of G/W rows), in `accum` micro-batches of
`micro` rows: the same count on every rank, enough for the largest share, ⌈⌈G/W⌉/micro⌉. A
rank with fewer rows fills its last slots with label-free padding, which adds nothing to the
loss or the gradient; that is only allowed with `training.pad_uneven_batches`.

The config validates every world size in the scaling range with it, the data stream cuts each
rank's rows with it, and the train loop sizes its accumulation with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

# The label of a position that trains nothing (a prompt token, padding): PyTorch's and
# Hugging Face's cross-entropy ignore_index.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int
    world_size: int
    micro_batch: int

    @property
    def accum(self) -> int:
        """Micro-batches per step, the same on every rank."""
        return math.ceil(math.ceil(self.global_batch / self.world_size) / self.micro_batch)

    @property
    def padding_rows(self) -> int:
        """Label-free slots per step across all ranks."""
        return self.accum * self.world_size * self.micro_batch - self.global_batch

    def bounds(self, rank: int) -> tuple[int, int]:
        """The slots of each step's global batch that `rank` takes."""
        g, w = self.global_batch, self.world_size
        return rank * g // w, (rank + 1) * g // w

    def rows_per_step(self, rank: int) -> int:
        lo, hi = self.bounds(rank)
        return hi - lo

    def problem(self, pad_uneven_batches: bool) -> Optional[str]:
        """Why this split is refused, or None."""
        if pad_uneven_batches:
            if self.global_batch < self.world_size:
                return (f"training.global_batch_size {self.global_batch} < {self.world_size} workers: some workers "
                        f"would get no rows")
            return None
        if self.padding_rows:
            return (f"training.global_batch_size {self.global_batch} cannot be split into {self.world_size} workers "
                    f"x micro_batch_size {self.micro_batch}")
        return None
