"""Rollouts on a pool of actors (`rl.rollout: actors`): the training workers score, pack and train
as colocated rollouts do (app/rl/colocated.py), but the sampling runs on `rl.rollout_actors`
Ray actors, each holding a copy of the policy (a GPU each where the workers have one).

Each step:

1. **Publish.** The trainable weights after `step` optimizer steps (the LoRA adapters, or every
   weight of a full fine-tune) are policy version `step`. Every rank takes part in gathering them
   (FSDP2 shards them); rank 0 writes them to `<run>/policy/<version>/policy.safetensors`, puts
   them in the object store and hands the reference to each actor. The version before the last
   is deleted: a resumed run publishes its own.
2. **Sample.** Each rank splits its share of the step's groups over the actors, whole groups per
   call, and asks for version `step`. An actor that does not hold it (it started late, restarted,
   or the object-store copy has not reached it yet) reads it from storage. Completion i is drawn
   from its own seed, as colocated: the completions are the same on any number of actors and
   at any world size, up to rounding (app/rl/sampling.py).
3. **Lost actors.** An actor that dies is restarted by Ray and the call it held is sent again
   (`max_restarts`, `max_task_retries`): its groups are regenerated whole from their seeds,
   never partly scored. Past the restarts the step fails, and the run recovers as from any lost
   worker: from its last checkpoint, with a new pool.

The pool belongs to the worker group: rank 0 creates it under a name of the group's own, so a
group started after a failure never finds the last one's actors, and they die with it.
"""

from __future__ import annotations

import logging
import os
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

from app.rl.colocated import ColocatedRollouts
from app.rl.sampling import Completions, sample_completions
from app.storage import Store, join

log = logging.getLogger(__name__)

NAMESPACE = "eft-rollouts"
POLICY_FILE = "policy.safetensors"
# Restarts of one actor, and resends of the call it held, before the step fails (then the run
# restarts from its checkpoint with a new pool, as for a lost training worker).
MAX_RESTARTS = 4
# How long the pool may take to start (each actor loads the model) before the step gives up.
START_TIMEOUT_S = 600.0


def policy_uri(run_uri: str, version: int) -> str:
    return join(run_uri, "policy", f"{version:08d}", POLICY_FILE)


def actor_name(run_name: str, pool: str, index: int) -> str:
    return f"eft-rollout-{run_name}-{pool}-{index}"


def gather_policy(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable weights, whole, on rank 0's CPU (empty elsewhere). Every rank must call:
    FSDP2's shards are gathered collectively. DDP's `module.` prefix is dropped, so the names are
    the plain model's, as the actors' copy has them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                 ignore_frozen_params=True))


class RolloutActor:
    """One copy of the policy that samples completions of a given version. Its model is the
    base (+ LoRA) as `eft export` loads it; its trainable weights are replaced by each version's."""

    def __init__(self, cfg_tree: dict, stop_ids: list[int], pad_id: int):
        import ray

        from app.config import JobConfig
        from app.model.build import load_pretrained, resolve_precision
        from app.observe.records import record_event

        self.cfg = JobConfig.model_validate(cfg_tree)
        self.store = Store.from_config(self.cfg.storage)
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        precision = resolve_precision(self.cfg, self.device)
        self.autocast_dtype = precision.param_dtype
        local_dir = self.store.cache_locally(self.cfg.model.uri)
        self.model = load_pretrained(local_dir, precision.storage_dtype, self.cfg.lora, self.cfg.training.seed)
        self.model.to(self.device).eval()
        self.stop_ids, self.pad_id = set(stop_ids), pad_id
        self.version, self.offered, self.exit_next = None, {}, False
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        record_event(self.store, self.cfg.run_uri, "rollout_actor_start", wait_s=2.0,
                     actor=ray.get_runtime_context().get_actor_name(), restarted=bool(restarted))

    def ready(self) -> bool:
        """Answered once the constructor is done (the model loaded)."""
        return True

    def offer_policy(self, version: int, weights: dict) -> None:
        """Rank 0's object-store copy of a version; taken when a call asks for it."""
        self.offered = {version: weights}

    def exit_during_next_generate(self) -> None:
        """For rehearsals (tests, bench): the next `generate` dies after sampling, its work lost,
        as when the actor's node is reclaimed mid-step."""
        self.exit_next = True

    def generate(self, version: int, prompts: list[list[int]], seeds: list[int], max_new_tokens: int,
                 temperature: float, top_p: float) -> tuple[list[list[int]], list[bool]]:
        self.load_policy(version)
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype is not None
                    else torch.autocast(self.device.type, enabled=False))
        with autocast:
            out = sample_completions(self.model, prompts, seeds, max_new_tokens=max_new_tokens,
                                     stop_token_ids=self.stop_ids, pad_token_id=self.pad_id,
                                     temperature=temperature, top_p=top_p)
        if self.exit_next:
            os._exit(1)
        return out.tokens, out.truncated

    def load_policy(self, version: int) -> None:
        if version == self.version:
            return
        weights = self.offered.pop(version, None)
        if weights is None:
            from safetensors.torch import load

            weights = load(self.store.read_bytes(policy_uri(self.cfg.run_uri, version)))
        result = self.model.load_state_dict(weights, strict=False)
        if result.unexpected_keys:
            raise RuntimeError(f"policy version {version}: weights the rollout model does not have: "
                               f"{result.unexpected_keys[:3]}")
        self.version, self.offered = version, {}


def wait_until_started(actors: list, options: dict, timeout_s: float) -> None:
    """Every actor up (its model loaded), or one line saying what did not fit, rather than a
    first step that waits forever on actors the cluster has no room for."""
    import ray

    ready, _ = ray.wait([a.ready.remote() for a in actors], num_returns=len(actors), timeout=timeout_s)
    if len(ready) < len(actors):
        gpu = " and 1 GPU" if options["num_gpus"] else ""
        raise RuntimeError(f"rl.rollout_actors: {len(actors) - len(ready)} of {len(actors)} rollout actor(s) "
                           f"({options['num_cpus']:g} CPU{gpu} each, rl.rollout_cpus_per_actor) not started within "
                           f"{timeout_s:.0f} s: the cluster has no room for them beside the workers")
    ray.get(ready)  # an actor whose start raised (a model it cannot load) says so here


def find_actor(name: str, timeout_s: float = 60.0):
    """A pool actor rank 0 created (its name may take a moment to register)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class ActorRollouts(ColocatedRollouts):
    """Colocated rollouts whose sampling is sent to the pool (see the module's docstring)."""

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        self.store = Store.from_config(cfg.storage)
        self.actors = self.start_pool()

    def start_pool(self) -> list:
        import ray

        pool = [uuid.uuid4().hex[:8] if self.rank == 0 else None]
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(pool, src=0)
        names = [actor_name(self.cfg.name, pool[0], i) for i in range(self.rl.rollout_actors)]
        if self.rank == 0:
            remote = ray.remote(RolloutActor)
            options = dict(namespace=NAMESPACE, num_cpus=self.rl.rollout_cpus_per_actor,
                           num_gpus=1 if self.cfg.scaling.use_gpu else 0, max_restarts=MAX_RESTARTS,
                           max_task_retries=MAX_RESTARTS)
            tree = self.cfg.model_dump(mode="json")
            actors = [remote.options(name=n, **options).remote(tree, sorted(self.stop_ids), self.pad_id)
                      for n in names]
            wait_until_started(actors, options, START_TIMEOUT_S)
            log.info("rollout pool: %d actor(s) %s-*", len(names), names[0].rsplit("-", 1)[0])
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        if self.rank != 0:
            actors = [find_actor(n) for n in names]
        return actors

    def sample(self, model, prompt_ids: list[list[int]], seeds: list[int], step: int) -> Completions:
        import ray

        self.publish(model, step)
        g = self.rl.group_size
        groups = len(prompt_ids) // g
        # Whole groups per call, spread evenly: a lost call regenerates whole groups.
        bounds = np.linspace(0, groups, min(len(self.actors), groups) + 1).round().astype(int) * g
        calls = [actor.generate.remote(step, prompt_ids[a:b], seeds[a:b], self.rl.max_new_tokens,
                                       self.rl.temperature, self.rl.top_p)
                 for actor, a, b in zip(self.actors, bounds[:-1], bounds[1:]) if b > a]
        tokens, truncated = [], []
        for got_tokens, got_truncated in ray.get(calls):
            tokens += got_tokens
            truncated += got_truncated
        return Completions(tokens=tokens, truncated=truncated)

    def publish(self, model, version: int) -> None:
        """Policy `version` to storage and the object store (every rank gathers; rank 0 writes),
        then every rank may ask for it."""
        import ray
        from safetensors.torch import save

        weights = gather_policy(model)
        if self.rank == 0:
            started = time.monotonic()
            self.store.write_bytes(policy_uri(self.cfg.run_uri, version), save(weights))
            if version >= 2:
                self.store.delete_prefix(join(self.cfg.run_uri, "policy", f"{version - 2:08d}"))
            ref = ray.put(weights)
            for actor in self.actors:
                actor.offer_policy.remote(version, ref)
            log.debug("policy version %d published in %.2f s", version, time.monotonic() - started)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # written before any rank asks for it
