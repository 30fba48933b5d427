"""`eft manifests CONFIG --serve`: the run's export served on a cluster.

Reads the export (its export.json, the served tree's chat template and weight sizes; a LoRA
adapter's rank) with the interactive store, so an unreachable bucket is one line in seconds, then
renders, from one Serve LLM config (app/serve/llm_config.py):
- the KubeRay manifests (app/kube/service.py): a RayService with that config as `serveConfigV2`,
  its NetworkPolicy, head PodDisruptionBudget and ServiceAccount, validated strictly against the
  vendored CRDs and the policy before anything is written;
- `serve.yaml`: the same Serve application, for `serve deploy` on any Ray cluster;
- `vllm-serve.sh` (and `chat_template.jinja`): the same model, name and template under plain vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import yaml

from app import kube
from app.config import JobConfig
from app.serve.llm_config import (TEMPLATE_FILE, build_llm_config_dict, build_serve_app_config,
                                  build_vllm_script, check_llm_config, check_serve_app_config, pick_tensor_parallel,
                                  served_model_ids)
from app.serve.source import (ServedModel, ServeSourceError, read_chat_template, read_lora_rank, read_weight_bytes,
                              resolve_run_export)
from app.storage import Store, is_s3


@dataclass
class ServeRender:
    manifests: dict[str, dict]
    files: dict[str, str]  # beside the manifests: serve.yaml, vllm-serve.sh, chat_template.jinja
    warnings: list = field(default_factory=list)
    served: Optional[ServedModel] = None
    model_ids: list[str] = field(default_factory=list)
    tensor_parallel_size: int = 1
    node: str = ""


def render_serve(cfg: JobConfig, config_label: str, export_uri: Optional[str], overlay: Optional[str],
                 image: Optional[str], node_type: Optional[str] = None, crd_dir: Optional[str] = None,
                 store: Optional[Store] = None) -> ServeRender:
    """Everything `--serve` writes, checked; ConfigError / ServeSourceError / LLMConfigError, one line."""
    node = kube.resolve_serve_node(cfg, overlay, node_type)  # flags first: no storage read for a typo
    store = store or Store.from_config(cfg.storage, interactive=True)
    served = resolve_run_export(cfg, config_label, export_uri, prefer_adapter=cfg.serve.adapter, store=store)
    adapter = served.kind == "adapter"
    for uri in (served.model_uri, served.adapters_uri if adapter else None):
        if uri is not None and not is_s3(uri):
            raise ServeSourceError(f"{uri}: a RayService's pods read the export from object storage, and this is a "
                                   f"local path; export the run to an s3:// storage.root_uri")
    template = read_chat_template(store, served.tokenizer_uri)
    lora_rank = read_lora_rank(store, served.adapter_uri) if adapter else None
    tp = cfg.serve.tensor_parallel_size or pick_tensor_parallel(read_weight_bytes(store, served.model_uri),
                                                                node.gpu_memory_gib, node.gpus)
    s = cfg.serve
    llm = build_llm_config_dict(served, tensor_parallel_size=tp, chat_template=template,
                                min_replicas=s.min_replicas, max_replicas=s.max_replicas,
                                target_ongoing_requests=s.target_ongoing_requests, max_model_len=s.max_model_len,
                                lora_rank=lora_rank, max_adapters_per_replica=s.max_adapters_per_replica)
    check_llm_config(llm)
    app = build_serve_app_config([llm])
    check_serve_app_config(app)
    manifests, warnings = kube.render_service_checked(cfg, app, tp, overlay, image, node.name, crd_dir,
                                                      annotations={"eft/export-uri": served.export_uri})
    files = {"serve.yaml": yaml.safe_dump(app, sort_keys=False, width=120),
             "vllm-serve.sh": build_vllm_script(served, chat_template=template,
                                                tensor_parallel_size=tp, max_model_len=s.max_model_len,
                                                lora_rank=lora_rank)}
    if template is not None:
        files[TEMPLATE_FILE] = template
    return ServeRender(manifests, files, warnings, served, served_model_ids(served), tp, node.name)


