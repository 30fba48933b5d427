"""Count the collectives a piece of training puts on the wire: for tests and benches.

The process-group backends mark each collective they run with a profiler event ("gloo:all_gather",
"nccl:reduce_scatter", ...), whichever API issued it: FSDP2's gathers and reductions, DDP's
buckets, DTensor's own all-reduces (the gradient norm of sharded gradients), the loop's.
"""

from __future__ import annotations

import contextlib
from collections import Counter

BACKENDS = ("gloo:", "nccl:")


@contextlib.contextmanager
def count_collectives():
    """`with count_collectives() as calls: ...`; then calls["all_reduce"] etc. (backend prefix dropped)."""
    from torch.profiler import ProfilerActivity, profile

    calls: Counter = Counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield calls
    calls.update(e.name.split(":", 1)[1] for e in prof.events() if e.name.startswith(BACKENDS))
