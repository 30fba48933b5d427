"""app/compat.py, the one door to private Ray / torch / transformers APIs: every shim is documented,
works against the installed versions, and nothing else in app/ (or the tests) reaches a private
name. A version outside the checked range warns once, naming the shims at risk.

This file may name the private APIs: it checks the shims against them."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from app import compat

ROOT = Path(__file__).resolve().parents[1]
# Private names of the libraries eft depends on, as they would be written in code.
PRIVATE = re.compile(r"ray\._|ray\.train\.v2\._internal|torch\._|torch\.utils\._|tensor\._utils|\._spec\b|"
                     r"_local_tensor|_compiled_call_impl|_no_split_modules|_set_params_and_buffers|_slice_file|"
                     r"_resources_per_worker_not_none|_global_node|_raylet|_pyarrow_fs_copy_files|_state_type|"
                     r"_get_global_client")


def test_every_shim_says_what_it_stands_in_for():
    assert len(compat.SHIMS) >= 15
    for shim in compat.SHIMS.values():
        assert shim.library in compat.CHECKED_RANGES, shim
        assert shim.private and shim.public and re.search(r"\d+\.\d+", shim.checked), shim
        assert callable(getattr(compat, shim.name)), shim


def test_no_private_api_outside_compat():
    """Code under app/ and tests/ reaches private names only through app/compat.py (this file
    excepted: it checks the shims). The logger name torch.utils._pytree is a string, not an API."""
    found = []
    for path in sorted([*(ROOT / "app").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]):
        if path.name in ("compat.py", "test_compat.py"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if PRIVATE.search(code) and 'getLogger("torch.utils._pytree")' not in code:
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "private APIs outside app/compat.py:\n" + "\n".join(found)


def test_installed_versions_are_the_checked_ones():
    with warnings.catch_warnings():
        warnings.simplefilter("error", compat.CompatWarning)
        assert compat.check_versions() == []


@pytest.mark.parametrize("library,version,warns", [
    ("ray", "2.61.0", True), ("ray", "2.59.2", True), ("ray", "2.60.1", False), ("ray", "2.61.0rc1", True),
    ("torch", "2.13.0+cpu", False), ("torch", "2.14.1", True), ("torch", "2.12.0", True),
    ("transformers", "5.24.0", False), ("transformers", "4.57.0", True),
    # PEP 440 forms (packaging reads them): a nightly of a checked release, one of the next, no version.
    ("torch", "2.13.0.dev20260101+cu128", False), ("torch", "2.14.0a0+git1234abc", True),
    ("transformers", "not-a-version", True),
])
def test_a_version_outside_the_checked_range_warns_naming_the_shims(library, version, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        messages = compat.check_versions({library: version})
    assert bool(messages) == warns and len(caught) == len(messages) == int(warns)
    if warns:
        at_risk = [f"app.compat.{s.name}" for s in compat.SHIMS.values() if s.library == library]
        assert f"{library} {version}" in messages[0] and all(name in messages[0] for name in at_risk)


def test_the_warning_shows_at_import_on_a_stranger_ray(tmp_path):
    """A fresh interpreter that sees another Ray version prints the one warning when eft is imported."""
    probe = ("import importlib.metadata as m; real = m.version\n"
             "m.version = lambda name: '2.62.0' if name == 'ray' else real(name)\n"
             "import app\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "CompatWarning" in line]
    assert len(lines) == 1 and "ray 2.62.0" in lines[0] and "app.compat.reload_ray_auth" in lines[0]


# -- Ray (no cluster needed) -----------------------------------------------------------------


def test_controller_callback_base_has_the_hooks_eft_overrides():
    base = compat.controller_callback_base()
    for hook in ("after_controller_start", "on_controller_start_worker_group",
                 "before_controller_execute_resize_decision", "before_controller_execute_failure_decision",
                 "after_controller_state_update"):
        assert callable(getattr(base, hook)), hook


def test_resources_per_worker_fills_ray_defaults():
    from ray.train import ScalingConfig

    assert compat.resources_per_worker(ScalingConfig(num_workers=2)) == {"CPU": 1}
    assert compat.resources_per_worker(ScalingConfig(num_workers=2, use_gpu=True)) == {"GPU": 1}
    assert compat.resources_per_worker(ScalingConfig(num_workers=2, resources_per_worker={"CPU": 2, "slot": 1})) == \
        {"CPU": 2, "slot": 1}


def test_controller_state_name_reads_rays_state_names():
    from ray.train.v2._internal.execution.controller import state

    assert compat.controller_state_name(state.RunningState()) == "RUNNING"
    assert compat.controller_state_name(state.SchedulingState(scaling_decision=None)) == "SCHEDULING"
    assert compat.controller_state_name(object()) == "object"


def test_patch_checkpoint_copy_wraps_rays_upload_and_undoes():
    import importlib

    module = importlib.import_module(compat.RAY_CHECKPOINT_COPY[0])
    original = getattr(module, compat.RAY_CHECKPOINT_COPY[1])
    undo = compat.patch_checkpoint_copy(lambda upload: ("wrapped", upload))
    try:
        assert getattr(module, compat.RAY_CHECKPOINT_COPY[1]) == ("wrapped", original)
    finally:
        undo()
    assert getattr(module, compat.RAY_CHECKPOINT_COPY[1]) is original


def test_reload_ray_auth_rereads_the_environment():
    """Run in a fresh interpreter: it changes process-wide Ray state."""
    probe = ("import os, ray\n"
             "from ray._raylet import AuthenticationTokenLoader\n"
             "from app.compat import reload_ray_auth\n"
             "os.environ.update(RAY_AUTH_MODE='token', RAY_AUTH_TOKEN='0123abcd' * 8)\n"
             "reload_ray_auth()\n"
             "assert AuthenticationTokenLoader.instance().has_token()\n"
             "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in __import__("os").environ.items()
                                 if not k.startswith("RAY_AUTH")})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


# -- torch -----------------------------------------------------------------------------------


@pytest.fixture
def one_rank_group():
    """A one-rank gloo group in this process, for DTensors."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dtensor_shims_on_a_sharded_tensor(one_rank_group):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    full = torch.arange(12.0).reshape(4, 3)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    assert compat.local_shape_and_offset(sharded) == ((4, 3), (0, 0))
    assert compat.local_tensor(sharded).equal(full) and compat.local_tensor(full) is full
    again = compat.dtensor_like(torch.ones(4, 3), sharded)
    assert isinstance(again, DTensor) and again.placements == sharded.placements and not again.requires_grad
    assert again.full_tensor().equal(torch.ones(4, 3))


def test_ddp_ignore_leaves_named_parameters_out(one_rank_group):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    compat.ddp_ignore(model, ["0.weight"])
    ddp = DistributedDataParallel(model)
    assert set(ddp.parameters_to_ignore) == {"0.weight"}
    # Left out of DDP's buckets: its gradient is the local one, never reduced or bucketed.
    bucketed = {id(p) for p in ddp._module_copies[0].parameters()} if hasattr(ddp, "_module_copies") else None
    assert bucketed is None or id(model[0].weight) not in bucketed


def test_foreach_copy_and_compiled_module_and_graph_count():
    import torch

    dst, src = [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.full((3,), 2.0)]
    compat.foreach_copy_(dst, src)
    assert all(d.equal(s) for d, s in zip(dst, src))
    compat.foreach_add_(dst, src)
    assert all(d.equal(2 * s) for d, s in zip(dst, src))
    class Block(torch.nn.Module):  # dynamo skips torch.nn's own modules at the top level
        def forward(self, x):
            return torch.relu(x) + 1

    block = Block()
    assert not compat.is_compiled_module(block)
    compat.reset_compile_state()
    block.compile(backend="aot_eager")
    assert compat.is_compiled_module(block)
    block(torch.ones(1, 2))
    assert compat.compiled_graph_count() == 1
    compat.reset_compile_state()
    assert compat.compiled_graph_count() == 0


def test_record_reader_reads_each_record_in_one_piece(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"a": torch.arange(10.0), "b": torch.ones(3, 3)}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    calls = []

    class Reader(compat.record_reader_base()):
        def read_record(self, file, offset, length):
            calls.append(length)
            file.seek(offset)
            return file.read(length)

    loaded = {"a": torch.zeros(10), "b": torch.zeros(3, 3)}
    dcp.load(loaded, storage_reader=Reader(str(tmp_path)), no_dist=True)
    assert loaded["a"].equal(state["a"]) and loaded["b"].equal(state["b"]) and len(calls) == 2


def test_dispatch_mode_api_counts_a_live_tensor():
    from app.dev.memory import PeakTracker

    import torch

    with PeakTracker() as tracker:
        kept = torch.ones(1024)  # noqa: F841: alive at the peak
    assert tracker.peak >= 4096


# -- transformers ----------------------------------------------------------------------------


def test_no_split_module_names_of_a_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    assert compat.no_split_module_names(LlamaForCausalLM(config)) == {"LlamaDecoderLayer"}
    assert compat.no_split_module_names(object()) == set()


# -- Ray, on the session's cluster ------------------------------------------------------------


def test_session_dir_coordinator_and_drain_call_on_a_live_ray(ray_cluster):
    """The session dir holds the session's logs; Ray Data's autoscaling coordinator answers a
    recompute once a dataset has run; the GCS client has the drain call the spot rehearsals use
    (tests/test_elastic.py drains a node with it; draining this one would end the session)."""
    import ray
    import ray.data
    from ray.core.generated import autoscaler_pb2

    assert (Path(compat.ray_session_dir()) / "logs").is_dir()
    ray.data.range(4).materialize()
    assert compat.refresh_autoscaling_coordinator("eft-test", timeout_s=30) is True
    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    assert callable(gcs.drain_node)
    assert autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION") > 0


def test_set_wandb_writer_marks_the_primary_and_a_second_writer():
    import wandb

    from app.compat import set_wandb_writer

    first, second = wandb.Settings(), wandb.Settings()
    set_wandb_writer(first, primary=True, shared=True)
    set_wandb_writer(second, primary=False, shared=False)
    assert (first.x_label, first.x_primary, first.x_update_finish_state) == ("train", True, True)
    assert (second.x_label, second.x_update_finish_state, second.x_sync_dir_suffix) == ("eval", False, "eval")
