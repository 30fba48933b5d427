"""Every private Ray / torch / DCP / transformers API eft uses, behind one door.

Each function here stands in for something the library offers no public API for (or whose public
API does not do what eft needs). Its `@shim` record says which private name it reaches, the public
API it stands in for (or why there is none), and the versions it was checked on. Nothing else in
`app/` may touch a private name of those libraries: an upgrade past the checked versions means
reading this one file, and `tests/test_compat.py` exercises every shim against the installed
versions.

At import (app/__init__.py calls `check_versions`), a Ray or torch outside the range the shims were
checked on gives one warning naming the shims at risk. Nothing heavy is imported here at module
level: each shim imports its library when called.
"""

from __future__ import annotations

import functools
import importlib
import io
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Callable, Optional

# (lowest checked, first version not checked) per library: the range every shim of that library
# was checked on. Ray is pinned to it in pyproject.toml; torch and transformers are not.
CHECKED_RANGES = {
    "ray": ("2.60", "2.61"),
    "torch": ("2.13", "2.14"),
    "transformers": ("5.0", "6.0"),
    "wandb": ("0.31", "0.32"),
}


class CompatWarning(UserWarning):
    """An installed library is outside the versions eft's shims were checked on."""


@dataclass(frozen=True)
class Shim:
    name: str
    library: str
    private: str  # the private name(s) it reaches
    public: str  # the public API it stands in for, or why none does the job
    checked: str  # the versions it was checked on


SHIMS: dict[str, Shim] = {}


def shim(library: str, private: str, public: str, checked: str) -> Callable:
    """Register a function as the one door to a private API."""

    def register(fn: Callable) -> Callable:
        SHIMS[fn.__name__] = Shim(fn.__name__, library, private, public, checked)
        return fn

    return register


# -- versions ---------------------------------------------------------------------------------


def installed_version(library: str) -> Optional[str]:
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string, by PEP 440 (packaging, which Ray, transformers and
    accelerate require): '2.13.0+cpu' → (2, 13, 0); '2.61.0rc1' → (2, 61, 0), so a pre-release of
    the first unchecked version counts as outside the range, as the release it leads to. A string
    that is no version at all → (): below every range."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except InvalidVersion:
        return ()


def outside_checked_range(library: str, version: Optional[str]) -> bool:
    if version is None or library not in CHECKED_RANGES:
        return False
    low, high = (release(v) for v in CHECKED_RANGES[library])
    return not (low <= release(version) < high)


def check_versions(versions: Optional[dict[str, Optional[str]]] = None) -> list[str]:
    """One CompatWarning per library whose installed version is outside the checked range, naming
    the shims at risk. Returns the messages (for tests); `versions` overrides what is installed."""
    messages = []
    for library in CHECKED_RANGES:
        version = versions[library] if versions is not None and library in versions else installed_version(library)
        if not outside_checked_range(library, version):
            continue
        at_risk = sorted(f"app.compat.{s.name}" for s in SHIMS.values() if s.library == library)
        low, high = CHECKED_RANGES[library]
        message = (f"{library} {version} is outside the versions eft's private-API shims were checked on "
                   f"(>={low},<{high}); these may break: {', '.join(at_risk)}")
        warnings.warn(message, CompatWarning, stacklevel=2)
        messages.append(message)
    return messages


# -- Ray -------------------------------------------------------------------------------------


@shim("ray", "ray.train.v2._internal.execution.callback.ControllerCallback",
      "none: Ray Train V2's controller hooks (worker-group start, failure and resize decisions) are a "
      "developer API importable only from _internal; RunConfig(callbacks=[UserCallback]) has no "
      "controller hooks", "ray 2.60.0")
def controller_callback_base() -> Optional[type]:
    """The base class of a Ray Train V2 controller callback, or None if this Ray has none."""
    try:
        from ray.train.v2._internal.execution.callback import ControllerCallback
    except ImportError:
        return None
    return ControllerCallback


@shim("ray", "ray.train.ScalingConfig._resources_per_worker_not_none",
      "ScalingConfig.resources_per_worker (None when left to Ray's default of 1 CPU, or 1 GPU)", "ray 2.60.0")
def resources_per_worker(scaling_config) -> dict:
    """The resources Ray Train reserves per worker, defaults filled in as Train fills them."""
    filled = getattr(scaling_config, "_resources_per_worker_not_none", None)
    return dict(filled or scaling_config.resources_per_worker or {})


@shim("ray", "ray.train.v2._internal.execution.controller.state.TrainControllerState._state_type",
      "type(state).__name__ (the class name, not Ray's state name)", "ray 2.60.0")
def controller_state_name(state) -> str:
    """The name Ray Train gives a controller state (RUNNING, RESTARTING, ...)."""
    kind = getattr(state, "_state_type", None)
    return getattr(kind, "state_name", type(state).__name__)


AUTOSCALING_COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")  # (name, namespace)


@shim("ray", "the detached actor AutoscalingCoordinator (ray.data._internal.cluster_autoscaler."
      "default_autoscaling_coordinator), get_reserved_resources(requester, recompute=True)",
      "none: Ray Train sizes an elastic restart from this actor's view, which it refreshes on its own "
      "20 s tick", "ray 2.60.0")
def refresh_autoscaling_coordinator(requester: str, timeout_s: float = 10.0) -> bool:
    """Make Ray's autoscaling coordinator re-read the cluster now. False when there is none (yet)."""
    import ray

    name, namespace = AUTOSCALING_COORDINATOR
    coordinator = ray.get_actor(name, namespace=namespace)
    ray.get(coordinator.get_reserved_resources.remote(requester, recompute=True), timeout=timeout_s)
    return True


@shim("ray", "ray._raylet.Config.initialize, ray._raylet.AuthenticationTokenLoader.instance().reset_cache",
      "setting RAY_AUTH_MODE / RAY_AUTH_TOKEN_PATH before ray is first imported; Ray reads them once "
      "per process", "ray 2.60.0")
def reload_ray_auth() -> None:
    """Make this process re-read Ray's token-auth settings from the environment (only valid before
    it joins or starts a cluster)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@shim("ray", "ray._raylet.GcsClient.drain_node, ray.core.generated.autoscaler_pb2.DrainNodeReason",
      "the `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION` command (a process per call)", "ray 2.60.0")
def drain_node_for_preemption(gcs_address: str, node_id: str, deadline_ms: int, message: str) -> bool:
    """What a cloud's spot reclaim does to a node: drain it with reason PREEMPTION and a deadline
    (development only: the chaos rehearsals). Returns whether the GCS accepted it."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=gcs_address)
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    accepted, _ = gcs.drain_node(node_id, reason, message, int(deadline_ms))
    return bool(accepted)


@shim("ray", "ray._private.worker._global_node.get_session_dir_path()",
      "the /tmp/ray/session_latest link, which points at the newest session on the machine, not "
      "necessarily this process's", "ray 2.60.0")
def ray_session_dir() -> str:
    """The session directory (logs) of the Ray this process started or joined."""
    import ray

    return ray._private.worker._global_node.get_session_dir_path()


# Ray Train's own switch for its pre-emption watcher (propagated from the driver to the controller).
RAY_PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


@shim("ray", "ray.train.v2._internal.callbacks.preemption_callback.PreemptionCallback (its "
      "after_worker_group_start, _watcher, _stop_watcher, _poll_interval_s), "
      "ray.train.v2._internal.execution.preemption.PreemptionWatcher (its constructor and _stop_event), "
      "WorkerGroup.get_workers()",
      "none: Ray Train starts its watcher itself, as a restartable actor of its own per worker group, "
      "with the worker actors' handles as constructor arguments, which Ray's core worker logs as an "
      "error at every start", "ray 2.60.0")
def build_preemption_callback():
    """Ray Train's pre-emption watcher callback, its watcher run on a thread of the controller's
    own process instead of in an actor of its own (run with RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0
    so Ray does not start its own as well).

    Why not an actor: the watcher is a poll loop on a thread already (the GCS's draining nodes,
    then `mark_preempt` on each worker), and an actor costs a process per worker-group start that
    imports Ray (about 1.5 CPU-seconds, on the restart path of every resize and node loss). On the
    controller it lives and dies with what it serves: a node loss that takes the controller takes
    the run with it. Why not restartable, as Ray's actor is: its arguments are the handles of one
    worker group's actors, so a restarted watcher would only watch a dead group, and Ray warns (an
    error-level line at every start) that a restart could not rebuild those arguments anyway. None
    if this Ray has no such callback."""
    try:
        from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
        from ray.train.v2._internal.execution.preemption import PreemptionWatcher
    except ImportError:
        return None

    class ControllerThreadPreemptionCallback(PreemptionCallback):
        def after_worker_group_start(self, worker_group) -> None:
            self._stop_watcher()
            node_to_ranks, actors_by_rank = {}, {}
            for worker in worker_group.get_workers():
                rank = worker.distributed_context.world_rank
                node_to_ranks.setdefault(worker.metadata.node_id, []).append(rank)
                actors_by_rank[rank] = worker.actor
            self._watcher = PreemptionWatcher(node_to_ranks=node_to_ranks, poll_interval_s=self._poll_interval_s,
                                              worker_actors_by_rank=actors_by_rank)

        def _stop_watcher(self) -> None:
            watcher, self._watcher = self._watcher, None
            if watcher is not None:
                watcher._stop_event.set()  # its loop ends at its next wait; nothing to join

    return ControllerThreadPreemptionCallback()


@shim("ray", "DataParallelTrainer._create_default_callbacks, "
      "ray.train.v2._internal.callbacks.DatasetsCallback (its before_init_train_context and _datasets)",
      "none: Ray Train starts a DatasetManager actor for every worker group, whether or not the "
      "trainer was given datasets", "ray 2.60.0")
def build_torch_trainer_class():
    """Ray Train's `TorchTrainer`, less the DatasetManager actor it starts per worker group when it
    holds no datasets. eft gives it none: each worker streams its own rows (app/data/stream.py),
    so that actor only cost a process per group start (about 1.5 CPU-seconds importing Ray and Ray
    Data, on the restart path of every resize and node loss). The driver's DataContext still
    reaches the workers, as Ray's callback does it; given datasets, the trainer is Ray's own."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks import DatasetsCallback

    class DatasetsCallbackWithoutManager(DatasetsCallback):
        def before_init_train_context(self, workers) -> dict:
            if not self._datasets:
                return {}  # each worker's dataset_shard_provider stays None: nothing asks it
            return super().before_init_train_context(workers)

    class TorchTrainerWithoutIdleDatasetManager(TorchTrainer):
        def _create_default_callbacks(self) -> list:
            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            return [DatasetsCallbackWithoutManager(train_run_context=self.train_run_context, datasets={})
                    if type(c) is DatasetsCallback else c for c in callbacks]

    return TorchTrainerWithoutIdleDatasetManager


RAY_CHECKPOINT_COPY = ("ray.train.v2._internal.execution.storage", "_pyarrow_fs_copy_files")


@shim("ray", ".".join(RAY_CHECKPOINT_COPY),
      "none: Ray Train uploads a reported checkpoint with this function; tests wrap it to cut an "
      "upload off halfway", "ray 2.60.0")
def patch_checkpoint_copy(wrap: Callable[[Callable], Callable]) -> Callable[[], None]:
    """From now on in this process, Ray Train's checkpoint uploads go through `wrap(original)`
    (tests only: a worker that dies mid-upload). Returns what puts the original back. An async
    upload can run after the train function returns, so a worker leaves the patch in place."""
    module = importlib.import_module(RAY_CHECKPOINT_COPY[0])
    original = getattr(module, RAY_CHECKPOINT_COPY[1])
    setattr(module, RAY_CHECKPOINT_COPY[1], wrap(original))
    return lambda: setattr(module, RAY_CHECKPOINT_COPY[1], original)


@shim("ray", ".".join(RAY_CHECKPOINT_COPY),
      "pyarrow.fs.copy_files, without Ray's settings for uploads into S3 (no threads: apache/arrow#32372; "
      "64 MiB chunks)", "ray 2.60.0")
def copy_checkpoint_files(source: str, destination: str, source_filesystem, destination_filesystem) -> None:
    """Copy a checkpoint directory into storage as Ray Train's own upload does. eft uploads
    checkpoints itself (app.elastic.checkpoint.commit_checkpoint, Ray Train's upload hook) and
    copies through Ray's function, looked up at each call, so `patch_checkpoint_copy` reaches
    eft's uploads as well."""
    module = importlib.import_module(RAY_CHECKPOINT_COPY[0])
    getattr(module, RAY_CHECKPOINT_COPY[1])(source, destination, source_filesystem=source_filesystem,
                                            destination_filesystem=destination_filesystem)


# -- torch -----------------------------------------------------------------------------------


@shim("torch", "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
      "DTensor.to_local() gives the shape but not the offset; DCP itself reaches the offset through "
      "the protocol method DTensor.__create_chunk_list__", "torch 2.13.0")
def local_shape_and_offset(tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(this rank's shape, its offset in the global tensor) of a DTensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(shape), tuple(offset)


@shim("torch", "DTensor._local_tensor",
      "DTensor.to_local(), an autograd op whose views a torchao NF4 tensor does not implement", "torch 2.13.0")
def local_tensor(tensor):
    """This rank's shard of a DTensor (FSDP2), or the tensor itself."""
    return getattr(tensor, "_local_tensor", tensor)


@shim("torch", "DTensor(local, spec, requires_grad=...) with template._spec",
      "DTensor.from_local(local, mesh, placements, shape=, stride=), which views the local tensor in "
      "ways a torchao NF4 tensor does not implement", "torch 2.13.0")
def dtensor_like(local, template):
    """A DTensor holding `local` as this rank's shard, placed as `template` is (mesh, placements,
    global shape and stride), without gradient."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, template._spec, requires_grad=False)


@shim("torch", "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",
      "none: DDP's only way to leave named parameters out of its broadcast and all-reduce", "torch 2.13.0")
def ddp_ignore(module, names: list[str]) -> None:
    """Have DistributedDataParallel, when it wraps `module`, neither broadcast nor reduce `names`."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(names))


@shim("torch", "torch._foreach_copy_", "Tensor.copy_ per tensor (one kernel launch each)", "torch 2.13.0")
def foreach_copy_(destinations: list, sources: list) -> None:
    """Copy each source into its destination, in as few kernels as the device allows."""
    import torch

    torch._foreach_copy_(destinations, sources)


@shim("torch", "torch._foreach_add_", "Tensor.add_ per tensor (one kernel launch each)", "torch 2.13.0")
def foreach_add_(totals: list, addends: list) -> None:
    """Add each addend into its total, in as few kernels as the device allows."""
    import torch

    torch._foreach_add_(totals, addends)


@shim("torch", "nn.Module._compiled_call_impl",
      "none for Module.compile() in place (torch.compile(module) returns a wrapper instead)", "torch 2.13.0")
def is_compiled_module(module) -> bool:
    """Whether `module.compile()` was called on this module."""
    return getattr(module, "_compiled_call_impl", None) is not None


@shim("torch", "torch._dynamo.utils.counters",
      "torch.compiler.reset() for the caches; none for dynamo's counters, which it leaves", "torch 2.13.0")
def reset_compile_state() -> None:
    """Forget every compiled graph and zero the count `compiled_graph_count` reads (tests)."""
    import torch
    import torch._dynamo.utils

    torch.compiler.reset()
    torch._dynamo.utils.counters.clear()


@shim("torch", "torch._dynamo.utils.counters['stats']['unique_graphs']",
      "none: torch.compiler has no public graph count", "torch 2.13.0")
def compiled_graph_count() -> int:
    """How many distinct graphs dynamo compiled since the last `reset_compile_state()` (tests)."""
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@shim("torch", "torch.distributed.checkpoint.FileSystemReader._slice_file",
      "FileSystemReader, whose reads of one record through a stream seek end first, then start: two "
      "remote round trips per record", "torch 2.13.0")
@functools.cache
def record_reader_base() -> type:
    """A DCP FileSystemReader whose subclasses read each record DCP loads in one piece, with
    `read_record(file, offset, length) -> bytes`. (Swapping the reader's `fs` for another file
    system is the public pattern torch's own FsspecReader follows; only the slicing is private.)"""
    from torch.distributed.checkpoint import FileSystemReader

    class RecordReader(FileSystemReader):
        def read_record(self, file, offset: int, length: int) -> bytes:
            raise NotImplementedError

        def _slice_file(self, file, sinfo):
            return io.BytesIO(self.read_record(file, sinfo.offset, sinfo.length))

    return RecordReader


@shim("torch", "torch.utils._python_dispatch.TorchDispatchMode, is_traceable_wrapper_subclass; "
      "torch.utils._pytree.tree_flatten",
      "none: the dispatch-mode API is documented but lives in a private module", "torch 2.13.0")
def dispatch_mode_api() -> tuple[type, Callable, Callable]:
    """(TorchDispatchMode, is_traceable_wrapper_subclass, tree_flatten), for counting live tensor
    bytes on any device (development only: app/dev/memory.py)."""
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
    from torch.utils._pytree import tree_flatten

    return TorchDispatchMode, is_traceable_wrapper_subclass, tree_flatten


# -- transformers ----------------------------------------------------------------------------


@shim("transformers", "PreTrainedModel._no_split_modules",
      "none: accelerate's device maps read the same attribute (infer_auto_device_map's "
      "no_split_module_classes)", "transformers 5.24.0")
def no_split_module_names(model) -> set[str]:
    """The class names of a model's blocks that must never be split (its decoder blocks)."""
    return set(getattr(model, "_no_split_modules", None) or [])


# -- Ray Serve LLM ---------------------------------------------------------------------------


@shim("ray", "ray.llm._internal.serve.core.configs.llm_config.LLMConfig",
      "ray.serve.llm.LLMConfig, the same model, which imports only where vLLM (or SGLang) is installed; "
      "eft renders Serve LLM configs on machines without it", "ray 2.60.0")
def validate_llm_config(config: dict) -> None:
    """Validate a Serve LLM config dict with Ray's own pydantic model (ValueError on a bad one)."""
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    LLMConfig.model_validate(config)


# -- Ray Serve -------------------------------------------------------------------------------


@shim("ray", "ray.serve.context._get_global_client().get_serve_details() (the Serve controller's "
      "get_serve_instance_details), read through the public ray.serve.schema.ServeInstanceDetails",
      "the dashboard's Serve REST API, GET /api/serve/applications/ (ServeInstanceDetails.http_options), "
      "which needs the dashboard's address and the cluster's Ray token, neither of which a driver on "
      "RAY_ADDRESS is sure to have; serve.status() leaves the HTTP options out", "ray 2.60.0")
def serve_http_address() -> Optional[tuple[str, int]]:
    """The host and port Serve's HTTP proxies listen on, as the running Serve controller holds
    them (serve.start keeps a running Serve's options, whatever it is asked); None without Serve."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeInstanceDetails

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return None
    options = ServeInstanceDetails(**client.get_serve_details()).http_options
    return options.host, options.port


# -- Weights & Biases -------------------------------------------------------------------------


@shim("wandb", "wandb.Settings' experimental x_primary, x_label, x_update_finish_state and x_sync_dir_suffix",
      "W&B's shared mode for distributed writers (docs: 'Log distributed training experiments', mode='shared' "
      "with x_primary / x_label), which has no public settings of its own yet", "wandb 0.31.0")
def set_wandb_writer(run_settings, primary: bool, shared: bool) -> None:
    """Mark a W&B run's settings as its primary writer (rank 0) or a second one (the eval task):
    a second writer never marks the run finished, and offline it writes a run directory of its own."""
    run_settings.x_label = "train" if primary else "eval"
    if shared:
        run_settings.x_primary = primary
    if not primary:
        run_settings.x_update_finish_state = False
        run_settings.x_sync_dir_suffix = "eval"
