"""Export: a training checkpoint → a PEFT adapter and/or a merged Hugging Face model.

Runs in one process on CPU. The checkpoint's DCP state dict ({"model", "optim"}) is read
into the same module tree training saved it from (base + LoRA built from the config), so
the keys match by construction. Output, under `<run>/export/<checkpoint dir name>/`:
  adapter/      PEFT `save_pretrained` (LoRA runs), plus tokenizer
  merged/       full model, safetensors, plus tokenizer (with `merge=True`; always for a
                full fine-tune)
Both trees carry the chat template conversations were trained with (see export_tokenizer), so
`AutoTokenizer.from_pretrained(tree).apply_chat_template(...)` renders the training format.
  export.json   what was exported from which checkpoint; written last, so a reader that
                finds it finds complete trees
A LoRA export also publishes its adapter at `<run>/adapters/<checkpoint dir name>/`, one folder per
exported checkpoint: the layout Ray Serve LLM's dynamic LoRA loading reads
(`lora_config.dynamic_lora_loading_path: <run>/adapters`, each subfolder an adapter it loads on
demand), so a RayService of the run serves every exported checkpoint without a redeploy.
A QLoRA run (`lora.quantize_base: nf4`) exports the same way: its checkpoint holds adapters only,
the export model is the original unquantized base, and merging folds the adapters into those
original weights (QLoRA's usual practice), never into the NF4 rounding they were trained over.
"""

from __future__ import annotations

import json
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Optional

from app.config import JobConfig
from app.elastic.checkpoint import (check_complete, check_local_copy, find_latest_checkpoint, load_sidecar,
                                    load_train_state)
from app.elastic.resume import resolve_run_model
from app.hub import is_hub_uri, load_marker, parse_hub_uri
from app.model.architecture import ModelError
from app.model.build import check_model_dir, load_pretrained
from app.storage import Store, StorageError, join

log = logging.getLogger(__name__)

EXPORT_DIR = "export"
EXPORT_MANIFEST = "export.json"
ADAPTER = "adapter"
MERGED = "merged"
ADAPTERS_DIR = "adapters"  # <run>/adapters/<checkpoint>/: Serve LLM's dynamic LoRA layout


class ExportError(RuntimeError):
    """An export problem, reported as one line naming the run, checkpoint or model at fault."""


def export_run(cfg: JobConfig, checkpoint_uri: Optional[str] = None, merge: bool = False,
               store: Optional[Store] = None) -> dict:
    """Export one checkpoint of `cfg`'s run (default: the latest complete one).

    Returns the summary also written to export.json: checkpoint URI, step, kinds written
    and the URI of each output tree.
    """
    store = store or Store.from_config(cfg.storage)
    requested = cfg.model.uri
    cfg = resolve_run_model(cfg, store)
    # A person waits on this: an unreachable endpoint or a bad bucket is one line in seconds,
    # before the (patient) store starts reading checkpoints and weights.
    quick = Store(store.endpoint, store.region, interactive=True)
    for uri in dict.fromkeys([cfg.run_uri, cfg.model.uri, *([checkpoint_uri] if checkpoint_uri else [])]):
        quick.check_reachable(uri)
    # Judged complete from its JSON sidecar alone: nothing of it is unpickled before that.
    ckpt_uri = pick_checkpoint(store, cfg.run_uri, checkpoint_uri)
    step = load_train_state(store, ckpt_uri).get("step")
    kinds = [ADAPTER, MERGED] if cfg.lora and merge else [ADAPTER] if cfg.lora else [MERGED]
    out_uri = join(cfg.run_uri, EXPORT_DIR, ckpt_uri.rstrip("/").rsplit("/", 1)[-1])
    log.info("exporting %s (step %s) as %s to %s", ckpt_uri, step, "+".join(kinds), out_uri)

    base_dir = cache_model_dir(store, cfg.model.uri)
    tokenizer = export_tokenizer(cfg, store)  # before the model: a bad template fails in seconds
    model = build_export_model(cfg, base_dir)
    load_checkpoint_weights(store, model, ckpt_uri, trainable_only=cfg.lora is not None)

    summary = {
        "run_uri": cfg.run_uri,
        "checkpoint_uri": ckpt_uri,
        "step": step,
        "base_model_uri": cfg.model.uri,
        "kinds": kinds,
        "export_uri": out_uri,
    }
    if (provenance := describe_hub_base(store, requested, cfg.model.uri)) is not None:
        summary["base_model_hub"] = provenance
    with tempfile.TemporaryDirectory(prefix="eft-export-") as tmp:
        summary.update(write_export_trees(cfg, model, tokenizer, base_dir, kinds, Path(tmp), out_uri))
        publish_export(store, Path(tmp), out_uri, summary)
    log.info("export complete: %s", out_uri)
    return summary


def describe_hub_base(store: Store, requested: str, model_uri: str) -> Optional[dict]:
    """Which hub commit the base is (repo, revision asked for, sha, mirror), from its mirror's
    marker; None for a base that is no hub mirror. A run given the mirror's URI itself counts too."""
    marker = load_marker(store, model_uri)
    if marker is None:
        return None
    revision = parse_hub_uri(requested).revision if is_hub_uri(requested) else marker.get("revision")
    return {"repo": marker["repo"], "revision": revision, "sha": marker["sha"], "mirror_uri": model_uri}


def write_export_trees(cfg: JobConfig, model, tokenizer, base_dir: Path, kinds: list[str],
                       local_dir: Path, out_uri: str) -> dict:
    """Write each kind under `local_dir`; returns the summary entries naming where they go."""
    written = {}
    # The adapter goes first: merging folds the adapters into the base and removes them.
    if ADAPTER in kinds:
        save_adapter(model, cfg.model.uri, local_dir / ADAPTER)
        tokenizer.save_pretrained(local_dir / ADAPTER)
        written["adapter_uri"] = join(out_uri, ADAPTER)
        written["adapter_id"] = out_uri.rstrip("/").rsplit("/", 1)[-1]
        written["adapters_uri"] = join(cfg.run_uri, ADAPTERS_DIR)
    if MERGED in kinds:
        merged = model.merge_and_unload() if cfg.lora else model
        written["merged_dtype"] = save_merged(merged, base_dir, tokenizer, local_dir / MERGED)
        written["merged_uri"] = join(out_uri, MERGED)
    return written


def pick_checkpoint(store: Store, run_uri: str, checkpoint_uri: Optional[str]) -> str:
    if checkpoint_uri is None:
        latest = find_latest_checkpoint(store, run_uri)
        if latest is None:
            raise ExportError(f"{run_uri}: no complete checkpoint to export")
        return latest
    checkpoint_uri = checkpoint_uri.rstrip("/")
    problem = check_complete(store, checkpoint_uri)
    if problem is not None:
        raise ExportError(f"{checkpoint_uri}: not a complete checkpoint ({problem})")
    return checkpoint_uri


def cache_model_dir(store: Store, model_uri: str) -> Path:
    # Checked before downloading so a wrong URI fails in one line, not deep in from_pretrained.
    if not store.exists(join(model_uri, "config.json")):
        raise ExportError(f"{model_uri}: not a Hugging Face model dir (no config.json)")
    try:
        return store.cache_locally(model_uri)
    except StorageError as err:
        raise ExportError(f"{model_uri}: cannot fetch base model ({err})") from None


def build_export_model(cfg: JobConfig, base_dir: Path):
    """Base in fp32 on CPU (merging in full precision), with LoRA applied by the same code
    training uses, so the module tree and its state-dict keys are the ones that were saved."""
    import torch

    try:
        check_model_dir(base_dir, cfg.model.uri)
        return load_pretrained(base_dir, torch.float32, cfg.lora)
    except ModelError as err:
        raise ExportError(str(err)) from None
    except (OSError, ValueError) as err:
        raise ExportError(f"{cfg.model.uri}: cannot load as a causal LM ({first_line(err)})") from None


def load_checkpoint_weights(store: Store, model, ckpt_uri: str, trainable_only: bool) -> None:
    """Read the checkpoint's "model" entry into `model`; its "optim" entry is never requested,
    and the default planner reads only the keys of the state dict it is given. DCP unpickles the
    checkpoint's metadata: the checkpoint was judged complete from its sidecar first, and the
    local copy is checked against that sidecar before the load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)

    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=trainable_only))
    with tempfile.TemporaryDirectory(prefix="eft-export-ckpt-") as local:
        files = load_sidecar(store, ckpt_uri)["files"]
        store.download_dir(ckpt_uri, local)
        try:
            check_local_copy(Path(local), files, ckpt_uri)
        except StorageError as err:
            raise ExportError(str(err)) from None
        try:
            with warnings.catch_warnings():
                # Loading in one process without a process group is the intent here, not a slip.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({"model": state}, checkpoint_id=local, no_dist=True)
        except (CheckpointException, RuntimeError, ValueError) as err:
            raise ExportError(f"{ckpt_uri}: checkpoint does not fit the model built from the config "
                              f"({describe_dcp_error(err)})") from None
    # The state dict usually aliases the parameters already; setting it makes that explicit
    # rather than relying on get_model_state_dict returning views.
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def save_adapter(model, base_model_uri: str, out_dir: Path) -> None:
    model.save_pretrained(out_dir, safe_serialization=True)
    # Record the base's URI, not the node-local cache path it was loaded from. Patched after
    # saving: PEFT's save reads config.json at that path to check the vocabulary size.
    config_path = out_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = base_model_uri
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def export_tokenizer(cfg: JobConfig, store: Store):
    """The training tokenizer, with the chat template its conversations were rendered with: for a
    chat or sharegpt run that set `prepare.chat_template`, that file (read as prepare reads it);
    otherwise the tokenizer's own, as it is."""
    from transformers import AutoTokenizer

    from app.data.engines import PrepareError, is_chat_format, read_chat_template

    try:
        tokenizer = AutoTokenizer.from_pretrained(store.cache_locally(cfg.tokenizer_uri))
    except (OSError, ValueError, StorageError) as err:
        raise ExportError(f"{cfg.tokenizer_uri}: cannot load tokenizer ({first_line(err)})") from None
    if cfg.prepare is not None and cfg.prepare.chat_template and is_chat_format(cfg):
        try:
            tokenizer.chat_template = read_chat_template(cfg, store, tokenizer)
        except PrepareError as err:
            raise ExportError(str(err)) from None
    return tokenizer


def save_merged(model, base_dir: Path, tokenizer, out_dir: Path) -> str:
    """Save in the base checkpoint's own dtype (bf16 for most released models), so the merged
    model is the size users expect; returns that dtype's name."""
    import torch

    dtype_name = read_base_dtype(base_dir)
    model = model.to(getattr(torch, dtype_name))
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return dtype_name


def read_base_dtype(base_dir: Path) -> str:
    import torch

    config = json.loads((base_dir / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return name if isinstance(getattr(torch, name, None), torch.dtype) else "float32"


def publish_export(store: Store, local_dir: Path, out_uri: str, summary: dict) -> None:
    """Committed-or-absent: any earlier export of this checkpoint goes first, each tree's config
    file lands after its weights, and export.json lands after everything. The adapter's copy for
    Serve LLM lands before export.json too: Serve lists that folder and loads an adapter when a
    request names it, and an adapter without its adapter_config.json fails that request rather than
    serving something half-written."""
    if store.exists(out_uri):
        store.delete_prefix(out_uri)
    if (local_dir / ADAPTER).is_dir():
        store.upload_dir(local_dir / ADAPTER, join(out_uri, ADAPTER), last=("adapter_config.json",))
        served = join(summary["adapters_uri"], summary["adapter_id"])
        if store.exists(served):
            store.delete_prefix(served)
        store.upload_dir(local_dir / ADAPTER, served, last=("adapter_config.json",))
    if (local_dir / MERGED).is_dir():
        store.upload_dir(local_dir / MERGED, join(out_uri, MERGED), last=("config.json",))
    store.write_json(join(out_uri, EXPORT_MANIFEST), summary)


def describe_dcp_error(err: BaseException) -> str:
    """DCP wraps each rank's failure (a missing key, a shape mismatch) in a CheckpointException
    whose own text is a traceback; report the first underlying failure instead."""
    failures = getattr(err, "failures", None)
    if failures:
        err = next(iter(failures.values()))[0]
    return first_line(err)


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
