"""A KubeRay RayService that serves a run's export: Ray Serve LLM (vLLM) on autoscaled GPU workers,
kept as private and hardened as the training job.

`build_service_manifests` takes the Serve application config (`serveConfigV2`, built by
app/serve/llm_config.py from the export) and how many GPUs one model replica holds, and renders:
- `rayservice.yaml`: the RayService, whose cluster has Ray token auth, non-root containers with a
  read-only root, the run's ServiceAccount without an API token (only the autoscaler's own
  mount), the head off spot and taking no work, and one GPU worker group that grows from the
  pods `serve.min_replicas` needs to those `serve.max_replicas` needs as Serve's autoscaler adds
  replicas;
- `networkpolicy-serve.yaml`: only pods labelled `eft/serve-client: "true"` reach the Serve port
  (KubeRay's `<name>-serve-svc`); Ray clients and the operator reach the head as for training;
- `poddisruptionbudget-serve.yaml`: the head is never drained;
- `serviceaccount.yaml`: the same account as training's (it holds the storage role).

The service's pods carry the run label `<run>-serve`, so the training job's policy and budget do
not select them, and theirs do not select training's.
"""

from __future__ import annotations

import math
from typing import Optional

import yaml

from app.config import ConfigError, JobConfig
from app.kube.render import (RAY_VERSION, Placement, build_cluster_spec, build_head_disruption_budget,
                             build_kube_name, build_labels, build_service_account, check_image, resolve_overlay,
                             CLIENT_LABEL, HEAD_CLIENT_PORTS, OPERATOR_LABELS, RUN_LABEL)
from app.nodes import NODE_TYPES, NodeType

SERVE_PORT = 8000
# Label a pod with this to let it call the served model (the Serve port, nothing else).
SERVE_CLIENT_LABEL = "eft/serve-client"
# Ray's own image with Ray Serve LLM and the vLLM it pins, at the Ray version the manifests declare.
SERVE_IMAGE = f"rayproject/ray-llm:{RAY_VERSION}-py311-cu128"
SERVE_SUFFIX = "-serve"


def build_service_name(cfg: JobConfig) -> str:
    """`<run>-serve`: the RayService, its run label and what KubeRay derives from it
    (`<name>-serve-svc`, its cluster `<name>-<5 chars>`) stay valid names under 63 characters."""
    return build_kube_name(cfg) + SERVE_SUFFIX


def resolve_serve_node(cfg: JobConfig, overlay_name: Optional[str], node_type: Optional[str]) -> NodeType:
    """A GPU node type: `--node-type`, else the overlay's GPU node (whatever the run trained on)."""
    overlay = resolve_overlay(overlay_name)
    name = node_type or overlay.gpu_node
    if name not in NODE_TYPES:
        raise ConfigError(f"--node-type: unknown node type {name!r} (known: {', '.join(NODE_TYPES)})")
    node = NODE_TYPES[name]
    if not node.gpus:
        raise ConfigError(f"--node-type: {name} has no GPUs; Ray Serve LLM (vLLM) serves on GPU nodes")
    if overlay.provider and node.provider != overlay.provider:
        raise ConfigError(f"--node-type: {name} is a {node.provider} node type; overlay {overlay.name} "
                          f"runs on {overlay.provider}")
    return node


def plan_serve_placement(cfg: JobConfig, node: NodeType, gpus_per_replica: int) -> Placement:
    """Whole-node GPU pods, each holding node GPUs / `gpus_per_replica` replicas; as many pods as
    serve.min_replicas and serve.max_replicas need."""
    if gpus_per_replica > node.gpus or node.gpus % gpus_per_replica:
        raise ConfigError(f"serve.tensor_parallel_size: {gpus_per_replica} GPUs per replica do not divide a "
                          f"{node.name} node's {node.gpus} GPUs")
    per_pod = node.gpus // gpus_per_replica
    lo, hi = (math.ceil(n / per_pod) for n in (cfg.serve.min_replicas, cfg.serve.max_replicas))
    return Placement(node, per_pod, lo, hi, node.cpus, node.memory_gib, node.gpus)


def build_serve_network_policy(name: str) -> dict:
    """Ingress to the service's pods from its own pods (Ray's ports), from serve clients to the
    Serve port only, from Ray clients to the head's dashboard and client ports, and from the
    KubeRay operator to the dashboard (it reads the Serve applications' status there)."""
    own = {"podSelector": {"matchLabels": {RUN_LABEL: name}}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "labels": build_labels(name)},
            "spec": {"podSelector": {"matchLabels": {RUN_LABEL: name}}, "policyTypes": ["Ingress"],
                     "ingress": [
                         {"from": [own]},
                         {"from": [{"podSelector": {"matchLabels": {SERVE_CLIENT_LABEL: "true"}}}],
                          "ports": [{"protocol": "TCP", "port": SERVE_PORT}]},
                         {"from": [{"podSelector": {"matchLabels": {CLIENT_LABEL: "true"}}}],
                          "ports": [{"protocol": "TCP", "port": port} for port in HEAD_CLIENT_PORTS.values()]},
                         {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(OPERATOR_LABELS)}}],
                          "ports": [{"protocol": "TCP", "port": HEAD_CLIENT_PORTS["dashboard"]}]}]}}


def build_service_manifests(cfg: JobConfig, serve_app: dict, gpus_per_replica: int, overlay_name: Optional[str],
                            image: Optional[str], node_type: Optional[str] = None,
                            annotations: Optional[dict] = None) -> dict[str, dict]:
    """file name → manifest for serving `serve_app` (a Serve config: `applications`, ...).
    Raises ConfigError (one line, naming the flag or key) when it cannot be placed."""
    overlay = resolve_overlay(overlay_name)
    image = image or SERVE_IMAGE
    if problem := check_image(image):
        raise ConfigError(f"--image: {problem}")
    node = resolve_serve_node(cfg, overlay_name, node_type)
    place = plan_serve_placement(cfg, node, gpus_per_replica)
    name = build_service_name(cfg)
    # Serving reads only the export in storage: the hub stays out of reach (safetensors from S3).
    spec = build_cluster_spec(cfg, overlay, image, place, name=name, config_map=None, fabric=False,
                              ports=(("serve", SERVE_PORT),), env=(("HF_HUB_OFFLINE", "1"),))
    service = {"apiVersion": "ray.io/v1", "kind": "RayService",
               "metadata": {"name": name, "labels": build_labels(name),
                            "annotations": {"eft/run-uri": cfg.run_uri, **(annotations or {})}},
               "spec": {"serveConfigV2": yaml.safe_dump(serve_app, sort_keys=False, width=120),
                        "rayClusterConfig": spec}}
    return {"rayservice.yaml": service,
            "networkpolicy-serve.yaml": build_serve_network_policy(name),
            "poddisruptionbudget-serve.yaml": build_head_disruption_budget(name),
            "serviceaccount.yaml": build_service_account(name, overlay)}
