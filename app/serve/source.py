"""What `eft serve CONFIG|EXPORT_URI` serves, found and checked before Ray starts.

An export (app/export.py) is a directory with export.json, written last, naming its trees: the
merged model (`merged/`) and/or the PEFT adapter (`adapter/`) over the base at `base_model_uri`.
A job CONFIG stands for the latest export of its run (`<run>/export/<checkpoint>/`). The merged
tree is served when there is one (one matmul per layer, nothing to fold at load); otherwise, or
with `prefer_adapter`, the base with the adapter merged into it as the replica loads it. Either
tree carries the chat template the run trained with; the tokenizer is read from the tree served.

Every problem (no such config, no export there, a tree missing) is one line naming the URI.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from app.storage import Store, StorageError, join

EXPORT_DIR = "export"  # as app/export.py names them
EXPORT_MANIFEST = "export.json"
CONFIG_SUFFIXES = (".yaml", ".yml")


class ServeSourceError(RuntimeError):
    """Nothing servable where `eft serve` was pointed; one line naming the URI or file."""


@dataclass(frozen=True)
class ServedModel:
    """Everything a replica needs to load the model; plain data, so it travels to the replicas."""

    name: str  # the `model` clients put in requests
    export_uri: str
    kind: str  # "merged" or "adapter"
    model_uri: str  # the merged tree, or the base the adapter goes on
    adapter_uri: Optional[str]
    tokenizer_uri: str  # the tree served: its tokenizer carries the training chat template
    step: Optional[int]
    endpoint: Optional[str]
    region: str
    # Serve LLM's dynamic LoRA layout (app/export.py): `<run>/adapters`, and this export's folder
    # in it; None for a merged-only export, or one written before eft published adapters there.
    adapters_uri: Optional[str] = None
    adapter_id: Optional[str] = None

    def to_dict(self) -> dict:
        return asdict(self)

    def engine_source(self) -> dict:
        """As app.eval.engine.load_eval_model takes a model to load."""
        return {"model_uri": self.model_uri, **({"adapter_uri": self.adapter_uri} if self.adapter_uri else {})}


def is_config_path(target: str) -> bool:
    return target.endswith(CONFIG_SUFFIXES)


def resolve_served_model(target: str, overrides: Optional[list[str]] = None, model_name: Optional[str] = None,
                         prefer_adapter: bool = False) -> ServedModel:
    """`target` (a job YAML, or an export's URI) → the ServedModel to start, checked in storage."""
    if is_config_path(target):
        from app.config import load_config

        cfg = load_config(target, overrides)  # ConfigError: one line, exit 2
        return resolve_run_export(cfg, target, model_name=model_name, prefer_adapter=prefer_adapter)
    else:
        if overrides:
            raise ServeSourceError("--set: only with a job CONFIG (an export URI has no config to override)")
        store = Store(interactive=True)
        export_uri = target.rstrip("/")
        check_reachable(store, export_uri)
    summary = read_export(store, export_uri)
    return served_from_export(store, export_uri, summary, model_name, prefer_adapter)


def resolve_run_export(cfg, config_label: str, export_uri: Optional[str] = None, model_name: Optional[str] = None,
                       prefer_adapter: bool = False, store: Optional[Store] = None) -> ServedModel:
    """The ServedModel of a run's export: `export_uri`, else the run's latest complete export."""
    store = store or Store.from_config(cfg.storage, interactive=True)
    check_reachable(store, export_uri or cfg.run_uri)
    if export_uri is None:
        export_uri = find_latest_export(store, cfg.run_uri)
        if export_uri is None:
            raise ServeSourceError(f"{config_label}: no export of run {cfg.run_uri} under "
                                   f"{join(cfg.run_uri, EXPORT_DIR)} (run `eft export {config_label}` first)")
    export_uri = export_uri.rstrip("/")
    return served_from_export(store, export_uri, read_export(store, export_uri), model_name, prefer_adapter)


def read_chat_template(store: Store, tree_uri: str) -> Optional[str]:
    """The chat template a tokenizer tree carries: `chat_template.jinja` (transformers 5 writes it
    beside the tokenizer), else `tokenizer_config.json`'s `chat_template` (a string, or named
    templates, whose `default` is the one apply_chat_template uses); None when it has none."""
    jinja = join(tree_uri, "chat_template.jinja")
    if store.exists(jinja):
        return store.read_text(jinja)
    config_uri = join(tree_uri, "tokenizer_config.json")
    if not store.exists(config_uri):
        return None
    try:
        template = store.read_json(config_uri).get("chat_template")
    except (ValueError, AttributeError):
        raise ServeSourceError(f"{config_uri}: unreadable (not a JSON object)") from None
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    return template if isinstance(template, str) else None


def read_weight_bytes(store: Store, model_uri: str) -> int:
    """The bytes of a model tree's safetensors weights: what a replica holds in GPU memory."""
    sizes = store.list_file_sizes(model_uri)
    total = sum(size for name, size in sizes.items() if name.endswith(".safetensors"))
    if not total:
        raise ServeSourceError(f"{model_uri}: no safetensors weights")
    return total


def read_lora_rank(store: Store, adapter_uri: str) -> int:
    """The LoRA rank `r` of an exported adapter (vLLM must be started with a --max-lora-rank that holds it)."""
    config_uri = join(adapter_uri, "adapter_config.json")
    try:
        rank = store.read_json(config_uri).get("r")
    except (ValueError, AttributeError):
        rank = None
    if not isinstance(rank, int) or rank < 1:
        raise ServeSourceError(f"{config_uri}: no LoRA rank `r` in it")
    return rank


def check_reachable(store: Store, uri: str) -> None:
    try:
        store.check_reachable(uri)
    except StorageError as err:
        raise ServeSourceError(str(err)) from None


def find_latest_export(store: Store, run_uri: str) -> Optional[str]:
    """The complete export (export.json present: it is written last) of the run's latest checkpoint."""
    root = join(run_uri, EXPORT_DIR)
    found = []
    for name in store.list_dirs(root):
        uri = join(root, name)
        if store.exists(join(uri, EXPORT_MANIFEST)):
            found.append((store.read_json(join(uri, EXPORT_MANIFEST)).get("step") or -1, name, uri))
    return max(found)[2] if found else None


def read_export(store: Store, export_uri: str) -> dict:
    manifest = join(export_uri, EXPORT_MANIFEST)
    if not store.exists(manifest):
        hint = (" (that is a tree of an export: give the directory above it)"
                if store.exists(join(export_uri, "config.json")) or store.exists(join(export_uri, "adapter_config.json"))
                else " (`eft export CONFIG` writes one under <run>/export/<checkpoint>/)")
        raise ServeSourceError(f"{export_uri}: no export here, no {EXPORT_MANIFEST}{hint}")
    try:
        return store.read_json(manifest)
    except (ValueError, StorageError) as err:
        raise ServeSourceError(f"{manifest}: unreadable ({str(err).splitlines()[0] if str(err) else err})") from None


def served_from_export(store: Store, export_uri: str, summary: dict, model_name: Optional[str],
                       prefer_adapter: bool) -> ServedModel:
    merged, adapter = summary.get("merged_uri"), summary.get("adapter_uri")
    base = summary.get("base_model_uri")
    if prefer_adapter and not adapter:
        raise ServeSourceError(f"{export_uri}: --adapter, but this export has no adapter (a full fine-tune exports "
                               f"merged/ only)")
    if merged and not prefer_adapter:
        kind, model_uri, adapter_uri, tokenizer_uri = "merged", merged, None, merged
        require(store, join(merged, "config.json"), "the merged model")
    elif adapter and base:
        kind, model_uri, adapter_uri, tokenizer_uri = "adapter", base, adapter, adapter
        require(store, join(adapter, "adapter_config.json"), "the adapter")
        check_reachable(store, base)
        require(store, join(base, "config.json"), "the base model the adapter goes on")
    else:
        raise ServeSourceError(f"{export_uri}/{EXPORT_MANIFEST}: names neither a merged model nor an adapter with "
                               f"its base")
    run_name = Path(str(summary.get("run_uri") or export_uri).rstrip("/")).name
    return ServedModel(name=model_name or run_name, export_uri=export_uri, kind=kind, model_uri=model_uri,
                       adapter_uri=adapter_uri, tokenizer_uri=tokenizer_uri, step=summary.get("step"),
                       endpoint=store.endpoint, region=store.region,
                       adapters_uri=summary.get("adapters_uri") if adapter else None,
                       adapter_id=summary.get("adapter_id") if adapter else None)


def require(store: Store, uri: str, what: str) -> None:
    if not store.exists(uri):
        raise ServeSourceError(f"{uri}: missing ({what} of the export)")
