"""Peak tensor memory of real training steps on CPU, to check `eft plan` against (development only).

CPU has no allocator statistics, and the process's resident size mixes in the interpreter,
libraries and whatever glibc keeps after a free. What the plan predicts is the bytes of live
tensors, the quantity torch.cuda.max_memory_allocated reports on GPU; `PeakTracker` counts the
same on any device: a TorchDispatchMode that sees every op's outputs (inner tensors of DTensors
included), adds each new storage's bytes once and subtracts them when the storage is freed, and
follows FSDP2's in-place storage resizes.
"""

from __future__ import annotations

import weakref

import torch
from app.compat import dispatch_mode_api

TorchDispatchMode, is_traceable_wrapper_subclass, tree_flatten = dispatch_mode_api()


class PeakTracker(TorchDispatchMode):
    """Live and peak bytes of the tensors created while it is active (and of `track`ed ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.live = 0
        self.peak = 0
        self._resize = None

    def track(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                self.track(getattr(tensor, name))
            return
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.sizes:
            return
        self.sizes[key] = storage.nbytes()
        self.refs[key] = weakref.ref(storage, lambda _, key=key: self._forget(key))
        self._add(self.sizes[key])

    def reset_peak(self) -> None:
        self.peak = self.live

    def _forget(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)

    def _add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def __enter__(self):
        tracker, original = self, torch.UntypedStorage.resize_
        self._resize = original

        def resize_(storage, size):
            key = id(storage)
            before = tracker.sizes.get(key)
            out = original(storage, size)
            if before is not None:
                tracker.sizes[key] = size
                tracker._add(size - before)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self.track(item)
        return out


def measure_training_peak(cfg, rank: int, world: int, steps: int = 2) -> dict:
    """Build the model from cfg.model.uri as a worker does (app.model.build.build_model: FSDP2 or
    DDP, precision, activation checkpointing) inside a tracker, then run `steps` optimizer steps of
    the loop's own forward/backward (app.model.loss.loss_sum after apply_loss, the adapters'
    gradient reduction) on random tokens. Returns the peak of the steps (the build's own transient copies are not part of training) and the bytes held
    before them. Needs torch.distributed initialized (gloo)."""
    from app.model.build import build_model, resolve_precision, trainable_parameters
    from app.model.loss import apply_loss, loss_sum
    from app.model.sharding import all_reduce_gradients, forward_autocast_dtype, replicated_parameters
    from app.storage import Store
    from app.train.loop import grad_sync_context

    device = torch.device("cpu")
    t = cfg.training
    accum = t.global_batch_size // (world * t.micro_batch_size)
    generator = torch.Generator().manual_seed(rank)
    with PeakTracker() as tracker:
        model = build_model(cfg, Store(), device, rank, world)
        apply_loss(model, t.loss, t.loss_chunk_tokens)
        for p in model.parameters():
            tracker.track(p)
        params = trainable_parameters(model)
        optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95))
        autocast = forward_autocast_dtype(model, resolve_precision(cfg, device).param_dtype)
        replicated = replicated_parameters(model)
        vocab = model.module.config.vocab_size if hasattr(model, "module") else model.config.vocab_size
        shape = (t.micro_batch_size, cfg.data.seq_len)
        tracker.reset_peak()
        held = tracker.live
        model.train()
        for _ in range(steps):
            for i in range(accum):
                x = torch.randint(0, vocab, shape, generator=generator)
                with grad_sync_context(model, enabled=i == accum - 1):
                    loss_sum(model, x, x, autocast).backward()
            all_reduce_gradients(replicated, world)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return {"peak_bytes": tracker.peak, "held_before_steps_bytes": held}
