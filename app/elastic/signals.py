"""A stop signal under torchrun: SIGTERM (Kubernetes' pod termination, its grace period running)
or SIGUSR1 (Slurm's `--signal=USR1@120` before the time limit) → a checkpoint at the next step
boundary, then every rank leaves the loop and the group exits 0.

Ray Train hands its workers a pre-emption notice with a deadline, so eft can train on and save as
late as is safe (app/elastic/preemption.py). A signal carries no deadline: the grace period is
the sender's, unknown here, so the save comes at once, at the first step boundary after the
signal, and no step done before it is lost. Any rank may get the signal (torchrun forwards its
own to every rank; a node's kubelet signals only its pods): the ranks agree on it every step, in
one all-reduce of one flag, the same cheap barrier Ray's notice check is.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Callable, Optional

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class SignalStop:
    """Handlers for STOP_SIGNALS that only note the signal; `after_step` says, the same on every
    rank, whether any rank got one. `agree` takes this rank's signal number (0 for none) and
    returns the largest of all ranks'."""

    def __init__(self, agree: Callable[[int], int], signals: tuple = STOP_SIGNALS):
        self.agree = agree
        self.received: int = 0
        self.previous = {}
        for sig in signals:
            self.previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum: int, _frame) -> None:
        self.received = signum  # a handler does nothing else: the loop acts at its next step boundary

    def after_step(self) -> Optional[signal.Signals]:
        signum = self.agree(self.received)
        return signal.Signals(signum) if signum else None

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def build_signal_stop(device) -> Optional[SignalStop]:
    """The group's SignalStop, or None where handlers cannot be set (not the main thread)."""
    import torch
    import torch.distributed as dist

    if threading.current_thread() is not threading.main_thread():
        return None

    def agree(signum: int) -> int:
        if not dist.is_initialized():
            return signum
        value = torch.tensor([signum], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    return SignalStop(agree)
