"""KubeRay manifests derived from a job config.

`build_manifests` turns a `JobConfig` into a ConfigMap (the resolved job.yaml), a RayJob that
creates its own cluster and runs `eft train /config/job.yaml`, and a standing RayCluster for
interactive `ray job submit` (created suspended, so applying a directory starts one cluster,
not two), plus what keeps them private: the run's ServiceAccount, a NetworkPolicy and a
PodDisruptionBudget for the head. The job config is the one source of truth: worker group
sizes, GPUs, the run name and the storage URI all come from it.

Hardening, in one place so the README and the policy check can name it:
- Ray token auth (`authOptions.mode: token`): KubeRay creates a Secret named after the
  RayCluster with a random `auth_token` and sets RAY_AUTH_MODE / RAY_AUTH_TOKEN on every Ray
  container, the autoscaler, the wait-gcs-ready init container and the RayJob submitter.
- Every container runs as the image's non-root `ray` user with no privilege escalation, no
  capabilities, the RuntimeDefault seccomp profile and a read-only root filesystem; what Ray
  and the libraries under it write goes to emptyDirs (/tmp, the cache dir, /dev/shm).
- Pods run as the overlay's dedicated ServiceAccount with no API token; only the head's
  autoscaler sidecar gets one (a projected token mounted into that container alone).
"""

from __future__ import annotations

import copy

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from app.config import ConfigError, JobConfig, dump_config
from app.kube.fabric import NODE_TYPE_ANNOTATION, apply_fabric, needs_fabric
from app.nodes import NODE_TYPES, NodeType

RAY_VERSION = "2.60.0"
CONFIG_MOUNT = "/config"
ENTRYPOINT = f"eft train {CONFIG_MOUNT}/job.yaml"
EVAL_ENTRYPOINT = f"eft eval {CONFIG_MOUNT}/job.yaml --checkpoint latest"
DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GPU_RESOURCE = "nvidia.com/gpu"
# Node labels that mark spot capacity, with the value that means spot.
SPOT_LABELS = {
    "karpenter.sh/capacity-type": "spot",
    "eks.amazonaws.com/capacityType": "SPOT",
    "cloud.google.com/gke-spot": "true",
}
ONE_DAY_S = 24 * 3600
# The image's non-root user: uid 1000 (`ray`) in the rayproject/ray images the Dockerfile builds on.
RAY_UID = 1000
RAY_GID = 100
# Label a pod with this to let it reach the head's dashboard and client ports (ray job submit,
# ray.init("ray://...")); everything else outside the run is refused by the NetworkPolicy.
CLIENT_LABEL = "eft/ray-client"
RUN_LABEL = "eft/run"
OPERATOR_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}  # the KubeRay Helm chart's pod label
HEAD_CLIENT_PORTS = {"dashboard": 8265, "client": 10001}
# Ray writes its session dir, logs and spilled objects under /tmp/ray, and eft caches the base
# model under the temp dir; libraries cache under XDG_CACHE_HOME and a few private dirs. With a
# read-only root these are emptyDirs, and the environment points every cache at CACHE_MOUNT.
TMP_MOUNT = "/tmp"
CACHE_MOUNT = "/cache"
CACHE_ENV = {"XDG_CACHE_HOME": CACHE_MOUNT, "HF_HOME": f"{CACHE_MOUNT}/huggingface",
             "TRITON_CACHE_DIR": f"{CACHE_MOUNT}/triton", "CUDA_CACHE_PATH": f"{CACHE_MOUNT}/nv",
             "MPLCONFIGDIR": f"{CACHE_MOUNT}/matplotlib"}
API_TOKEN_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
API_TOKEN_VOLUME = "kube-api-token"
# Ephemeral storage beyond the model cache: Ray's session logs, the container's writable layer
# (none: the root is read-only) and the kubelet's container logs.
EPHEMERAL_OVERHEAD_GIB = 10
HEAD_EPHEMERAL_GIB = 20


@dataclass(frozen=True)
class Overlay:
    name: str
    provider: Optional[str]  # None: any provider's node types
    spot: bool
    gpu_node: str
    cpu_node: str
    # AWS gives a 2-minute spot notice, GKE about 30 s: the drain must end before the kill.
    drain_timeout_s: int
    grace_period_s: int
    # Never `default`: the cloud role (IRSA, Pod Identity, Workload Identity) binds to this name,
    # and KubeRay binds the autoscaler's Role to the head's service account.
    service_account: str = "eft"
    queue: Optional[str] = None


OVERLAYS = {o.name: o for o in [
    Overlay("base", None, False, "p4d.24xlarge", "m6i.2xlarge", 90, 120),
    Overlay("eks-spot", "aws", True, "p4d.24xlarge", "m6i.2xlarge", 90, 110),
    Overlay("gke-spot", "gcp", True, "a3-highgpu-8g", "n2-standard-8", 15, 25),
    Overlay("kueue", None, False, "p4d.24xlarge", "m6i.2xlarge", 90, 120, queue="eft"),
]}


@dataclass(frozen=True)
class Placement:
    node: NodeType
    workers_per_pod: int
    min_replicas: int
    max_replicas: int
    pod_cpus: int
    pod_memory_gib: int
    pod_gpus: int


def resolve_overlay(name: Optional[str]) -> Overlay:
    if name not in OVERLAYS:
        raise ConfigError(f"--overlay: unknown overlay {name!r} (choose one of {', '.join(OVERLAYS)})")
    return OVERLAYS[name]


def lease_wait_s(cfg: JobConfig) -> int:
    """How long a retried driver waits for the run lease: two of its lifetimes, so a driver that
    died without releasing it is always outwaited."""
    return int(2 * cfg.fault_tolerance.run_lease_ttl_s + 60)


def resolve_node_type(cfg: JobConfig, overlay: Overlay, node_type: Optional[str]) -> NodeType:
    name = node_type or (overlay.gpu_node if cfg.scaling.use_gpu else overlay.cpu_node)
    if name not in NODE_TYPES:
        raise ConfigError(f"--node-type: unknown node type {name!r} (known: {', '.join(NODE_TYPES)})")
    node = NODE_TYPES[name]
    if overlay.provider and node.provider != overlay.provider:
        raise ConfigError(f"--node-type: {name} is a {node.provider} node type; overlay {overlay.name} "
                          f"runs on {overlay.provider}")
    if cfg.scaling.use_gpu and node.gpus == 0:
        raise ConfigError(f"scaling.use_gpu: true but node type {name} has no GPUs")
    if not cfg.scaling.use_gpu and node.gpus:
        raise ConfigError(f"scaling.use_gpu: false but node type {name} has {node.gpus} GPUs; pick a CPU node type")
    return node


def check_image(image: Optional[str]) -> Optional[str]:
    """Why an image reference is not pinned at all, or None. A digest pins; so does any tag but
    latest (a tag can still be re-pushed: `warn_image` says so)."""
    if not image:
        return "image missing"
    if "@sha256:" in image:
        return None
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return f"image {image!r} is not pinned by tag"
    if last.rsplit(":", 1)[1] == "latest":
        return f"image {image!r} uses the moving tag 'latest'"
    return None


def warn_image(image: Optional[str]) -> Optional[str]:
    """Why a pinned image could still change under a running cluster, or None."""
    if image and "@sha256:" not in image and check_image(image) is None:
        return f"image {image!r} is pinned by tag, not digest: a re-pushed tag changes what new pods run"
    return None


def plan_placement(cfg: JobConfig, node: NodeType) -> Placement:
    """Whole-node GPU pods (one Ray worker pod per node, one Ray Train worker per GPU share);
    CPU jobs get one Ray Train worker per pod."""
    s = cfg.scaling
    if s.min_workers > s.max_workers:
        raise ConfigError(f"scaling.min_workers: {s.min_workers} > scaling.max_workers ({s.max_workers})")
    if s.use_gpu:
        if s.gpus_per_worker > node.gpus:
            raise ConfigError(f"scaling.gpus_per_worker: {s.gpus_per_worker:g} GPUs per worker do not fit a "
                              f"{node.name} node ({node.gpus} GPUs)")
        per_pod = node.gpus / s.gpus_per_worker
        if per_pod != int(per_pod):
            raise ConfigError(f"scaling.gpus_per_worker: {s.gpus_per_worker:g} does not divide the "
                              f"{node.gpus} GPUs of a {node.name} node")
        per_pod = int(per_pod)
        cpus, memory, gpus = node.cpus, node.memory_gib, node.gpus
        if per_pod * s.cpus_per_worker > node.cpus:
            raise ConfigError(f"scaling.cpus_per_worker: {per_pod} workers x {s.cpus_per_worker:g} CPUs do not "
                              f"fit a {node.name} node ({node.cpus} CPUs for pods)")
    else:
        # One spare CPU per pod for the raylet and Ray Data's streaming reads.
        per_pod, cpus, gpus = 1, math.ceil(s.cpus_per_worker) + 1, 0
        memory = 4 * cpus
        if cpus > node.cpus:
            raise ConfigError(f"scaling.cpus_per_worker: {s.cpus_per_worker:g} CPUs per worker do not fit a "
                              f"{node.name} node ({node.cpus} CPUs for pods)")
    for key in ("min_workers", "max_workers"):
        count = getattr(s, key)
        if count % per_pod:
            raise ConfigError(f"scaling.{key}: {count} workers are not whole {node.name} nodes "
                              f"({per_pod} workers per node)")
    return Placement(node, per_pod, s.min_workers // per_pod, s.max_workers // per_pod, cpus, memory, gpus)


def build_kube_name(cfg: JobConfig) -> str:
    """The run name, used as is. It is also the run's S3 prefix, so rewriting it (A_B -> a-b)
    would let two runs with different storage share one RayJob, ConfigMap and auth Secret:
    a name that is not already a Kubernetes name is refused instead."""
    name = cfg.name
    # KubeRay derives Service and Secret names from it (<name>-head-svc, <name>-<5 chars> for a
    # RayJob's cluster): they stay under 63 characters and, starting with a letter, are valid
    # Service names that KubeRay leaves as they are (it rewrites a leading digit).
    if not re.fullmatch(r"[a-z]([a-z0-9-]{0,38}[a-z0-9])?", name):
        raise ConfigError(f"name: {name!r} is not a Kubernetes name (1..40 lowercase letters, digits or '-', "
                          f"starting with a letter and ending with a letter or digit); eft does not rewrite it "
                          f"because the run name is also the run's storage prefix")
    return name


def build_spot_affinity(overlay: Overlay) -> dict:
    """Workers: spot capacity only. EKS: Karpenter or managed node groups (the terms are OR'ed)."""
    if overlay.provider == "aws":
        terms = [{"matchExpressions": [{"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["spot"]}]},
                 {"matchExpressions": [{"key": "eks.amazonaws.com/capacityType", "operator": "In",
                                        "values": ["SPOT"]}]}]
    else:
        terms = [{"matchExpressions": [{"key": "cloud.google.com/gke-spot", "operator": "In", "values": ["true"]}]}]
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}


def build_head_affinity() -> dict:
    """Head: never on spot on any provider. NotIn also matches nodes without the label."""
    exprs = [{"key": k, "operator": "NotIn", "values": [v]} for k, v in SPOT_LABELS.items()]
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": exprs}]}}}


def build_spot_tolerations(overlay: Overlay) -> list[dict]:
    keys = ["karpenter.sh/capacity-type", "eks.amazonaws.com/capacityType"] if overlay.provider == "aws" \
        else ["cloud.google.com/gke-spot"]
    return [{"key": k, "operator": "Exists", "effect": "NoSchedule"} for k in keys]


def build_env(cfg: JobConfig, overlay: Overlay, drain: bool = True) -> list[dict]:
    """`drain`: Ray's graceful drain on a node's termination (torchrun pods stop on SIGTERM instead)."""
    env = [{"name": DRAIN_ENV, "value": str(overlay.drain_timeout_s)}] if drain else []
    env += [{"name": "AWS_DEFAULT_REGION", "value": cfg.storage.s3_region},
            {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"}]
    env += [{"name": key, "value": value} for key, value in CACHE_ENV.items()]
    if overlay.provider == "gcp":
        # The app speaks S3; on GKE that is GCS's S3 API with HMAC keys kept in a Secret.
        env += [{"name": key, "valueFrom": {"secretKeyRef": {"name": "eft-s3-hmac", "key": key, "optional": True}}}
                for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")]
    if cfg.storage.s3_endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": cfg.storage.s3_endpoint})
    return env


def build_resources(cpus: int, memory_gib: int, gpus: int, ephemeral_gib: int) -> dict:
    # requests == limits: Guaranteed QoS, and the device plugin demands equal GPU counts anyway.
    amounts = {"cpu": str(cpus), "memory": f"{memory_gib}Gi"}
    if gpus:
        amounts[GPU_RESOURCE] = str(gpus)
    # Disk is requested (so the scheduler places the model cache) but not limited: a limit evicts
    # the pod mid-run when a cache or Ray's logs outgrow a guess.
    return {"requests": dict(amounts, **{"ephemeral-storage": f"{ephemeral_gib}Gi"}), "limits": dict(amounts)}


def build_security_context() -> dict:
    """The container securityContext every pod keeps (the policy check requires each field)."""
    return {"runAsNonRoot": True, "runAsUser": RAY_UID, "runAsGroup": RAY_GID,
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def build_pod_security_context() -> dict:
    # fsGroup: volumes that honour it (the projected token among them) belong to the ray group.
    return {"runAsNonRoot": True, "runAsUser": RAY_UID, "runAsGroup": RAY_GID, "fsGroup": RAY_GID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def build_api_token_volume() -> dict:
    """What the kubelet would automount (token, CA, namespace), as a volume the head pod mounts
    into the autoscaler sidecar only, so a Ray job on the head holds no Kubernetes credentials."""
    return {"name": API_TOKEN_VOLUME, "projected": {"defaultMode": 0o644, "sources": [  # the kubelet's own mode
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}}


def build_labels(name: str) -> dict:
    return {"app.kubernetes.io/name": "eft", RUN_LABEL: name}


def build_pod_template(cfg: JobConfig, overlay: Overlay, image: str, *, head: bool, resources: dict,
                       config_map: Optional[str], shm_gib: int, extra: dict, name: Optional[str] = None,
                       ports: tuple[tuple[str, int], ...] = (), env: tuple[tuple[str, str], ...] = (),
                       container_name: Optional[str] = None, drain: bool = True) -> dict:
    """A Ray pod (or, with `container_name` and no `drain`, a torchrun pod): `name` labels it
    (default: the run's kube name); `config_map`, when given, is the job config mounted at
    CONFIG_MOUNT; `ports` are named container ports beyond the head's own."""
    container = {
        "name": container_name or ("ray-head" if head else "ray-worker"),
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "env": build_env(cfg, overlay, drain) + [{"name": k, "value": v} for k, v in env],
        "resources": resources,
        "securityContext": build_security_context(),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "tmp", "mountPath": TMP_MOUNT},
                         {"name": "cache", "mountPath": CACHE_MOUNT}],
    }
    if config_map is not None:
        container["volumeMounts"].append({"name": "job-config", "mountPath": CONFIG_MOUNT, "readOnly": True})
    named_ports = ([("gcs", 6379), ("dashboard", 8265), ("client", 10001)] if head else []) + list(ports)
    if named_ports:
        container["ports"] = [{"name": n, "containerPort": port} for n, port in named_ports]
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gib}Gi"}},
               {"name": "tmp", "emptyDir": {}},
               {"name": "cache", "emptyDir": {}}]
    if config_map is not None:
        volumes.append({"name": "job-config", "configMap": {"name": config_map}})
    if head:
        volumes.append(build_api_token_volume())
    spec = {
        "serviceAccountName": overlay.service_account,
        "automountServiceAccountToken": False,
        "securityContext": build_pod_security_context(),
        "terminationGracePeriodSeconds": overlay.grace_period_s,
        "containers": [container],
        "volumes": volumes,
        **extra,
    }
    annotations = {SAFE_TO_EVICT: "false", "karpenter.sh/do-not-disrupt": "true"} if head else {}
    meta = {"labels": build_labels(name or build_kube_name(cfg))}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": spec}


def build_cluster_spec(cfg: JobConfig, overlay: Overlay, image: str, place: Placement, *,
                       name: Optional[str] = None, config_map: Optional[str] = "", fabric: bool = True,
                       ports: tuple[tuple[str, int], ...] = (), env: tuple[tuple[str, str], ...] = ()) -> dict:
    """The RayCluster spec: a head off spot (no work on it) and one autoscaled worker group sized by
    `place`. `name` labels the pods (default: the run's kube name); `config_map` is the job config
    to mount (default `<name>-config`; None: none); `fabric` lets a multi-node GPU group request its
    fast fabric (training's collectives need it; serving replicas within a node do not)."""
    name = name or build_kube_name(cfg)
    config_map = f"{name}-config" if config_map == "" else config_map
    pod = {"name": name, "ports": ports, "env": env}
    head = build_pod_template(cfg, overlay, image, head=True, resources=build_resources(4, 16, 0, HEAD_EPHEMERAL_GIB),
                              config_map=config_map, shm_gib=4, extra={"affinity": build_head_affinity()}, **pod)
    # Autoscaler v2 replaces failed worker pods itself.
    worker = build_worker_template(cfg, overlay, image, place, config_map=config_map, fabric=fabric,
                                   restart_policy="Never", **pod)
    group = "gpu-workers" if place.pod_gpus else "cpu-workers"
    return {
        "rayVersion": RAY_VERSION,
        "authOptions": {"mode": "token"},
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {
            "version": "v2", "idleTimeoutSeconds": 120, "upscalingMode": "Default",
            "securityContext": build_security_context(),
            "volumeMounts": [{"name": "tmp", "mountPath": TMP_MOUNT},
                             {"name": API_TOKEN_VOLUME, "mountPath": API_TOKEN_MOUNT, "readOnly": True}],
        },
        # 0.0.0.0 inside the pod's network namespace is the pod IP plus loopback, and both are
        # needed: the head Service, the KubeRay operator and the submitter come in on the pod IP,
        # `kubectl port-forward` on loopback. Token auth and the NetworkPolicy decide who gets in.
        "headGroupSpec": {"rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"}, "template": head},
        "workerGroupSpecs": [{
            "groupName": group,
            "replicas": place.min_replicas,
            "minReplicas": place.min_replicas,
            "maxReplicas": place.max_replicas,
            "rayStartParams": {},
            "template": worker,
        }],
    }


def build_worker_template(cfg: JobConfig, overlay: Overlay, image: str, place: Placement, *, name: str,
                          config_map: Optional[str], fabric: bool = True, restart_policy: Optional[str] = None,
                          ports: tuple[tuple[str, int], ...] = (), env: tuple[tuple[str, str], ...] = (),
                          container_name: Optional[str] = None, drain: bool = True) -> dict:
    """A training pod on a whole node of `place`: spot-only on spot overlays (with the spot and GPU
    tolerations), pinned to the node type, sized to it, with its fabric when the group spans nodes.
    The Ray worker group's pods and Kubeflow's torchrun pods are both this."""
    extra: dict[str, Any] = {"restartPolicy": restart_policy} if restart_policy else {}
    tolerations = []
    if overlay.spot:
        extra["affinity"] = build_spot_affinity(overlay)
        tolerations += build_spot_tolerations(overlay)
    if place.pod_gpus:
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    if tolerations:
        extra["tolerations"] = tolerations
    if overlay.name != "base":
        extra["nodeSelector"] = {"node.kubernetes.io/instance-type": place.node.name}
    ephemeral = place.node.model_cache_gib + EPHEMERAL_OVERHEAD_GIB
    worker = build_pod_template(cfg, overlay, image, head=False,
                                resources=build_resources(place.pod_cpus, place.pod_memory_gib, place.pod_gpus,
                                                          ephemeral),
                                config_map=config_map, shm_gib=max(1, place.pod_memory_gib // 3), extra=extra,
                                name=name, ports=ports, env=env, container_name=container_name, drain=drain)
    # The node type the pods are sized for, so the policy check knows its fabric on any overlay.
    worker["metadata"].setdefault("annotations", {})[NODE_TYPE_ANNOTATION] = place.node.name
    if fabric and (needed := needs_fabric(place.node, place.max_replicas, place.pod_gpus)):
        apply_fabric(worker, needed, place.node)
    return worker


def build_submitter_template(name: str, overlay: Overlay, image: str) -> dict:
    """The K8sJobMode submitter pod (`ray job submit` against the head), hardened like the Ray
    pods; KubeRay fills in its command and the auth token. The run label lets it through the
    NetworkPolicy."""
    container = {"name": "ray-job-submitter", "image": image, "imagePullPolicy": "IfNotPresent",
                 "securityContext": build_security_context(),
                 "env": [{"name": "HOME", "value": TMP_MOUNT}],
                 "volumeMounts": [{"name": "tmp", "mountPath": TMP_MOUNT}],
                 "resources": {"requests": {"cpu": "500m", "memory": "512Mi", "ephemeral-storage": "1Gi"},
                               "limits": {"cpu": "1", "memory": "1Gi"}}}
    return {"metadata": {"labels": build_labels(name)},
            "spec": {"serviceAccountName": overlay.service_account, "automountServiceAccountToken": False,
                     "securityContext": build_pod_security_context(), "restartPolicy": "Never",
                     "containers": [container], "volumes": [{"name": "tmp", "emptyDir": {}}]}}


def build_network_policy(name: str) -> dict:
    """Ingress to the run's pods only from the run's own pods (any port: GCS, raylets, object
    managers, Ray workers and NCCL between workers all use ports Ray picks), from pods labelled
    CLIENT_LABEL to the head's dashboard and client ports, and from the KubeRay operator to the
    dashboard (it polls the job's status there). Egress stays open: S3 and the model hub."""
    run = {"podSelector": {"matchLabels": {RUN_LABEL: name}}}
    head_ports = [{"protocol": "TCP", "port": port} for port in HEAD_CLIENT_PORTS.values()]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{name}-ray", "labels": build_labels(name)},
            "spec": {"podSelector": {"matchLabels": {RUN_LABEL: name}}, "policyTypes": ["Ingress"],
                     "ingress": [
                         {"from": [run]},
                         {"from": [{"podSelector": {"matchLabels": {CLIENT_LABEL: "true"}}}], "ports": head_ports},
                         {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(OPERATOR_LABELS)}}],
                          "ports": [{"protocol": "TCP", "port": HEAD_CLIENT_PORTS["dashboard"]}]}]}}


def build_head_disruption_budget(name: str) -> dict:
    # maxUnavailable 0, not minAvailable 1: the RayJob's head and the standing cluster's head both
    # match, and neither may be drained (a lost head ends the run's cluster).
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": f"{name}-head", "labels": build_labels(name)},
            "spec": {"maxUnavailable": 0,
                     "selector": {"matchLabels": {RUN_LABEL: name, "ray.io/node-type": "head"}}}}


def build_config_map(cfg: JobConfig, name: str) -> dict:
    """The resolved job.yaml that every pod of the run mounts at CONFIG_MOUNT."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-config", "labels": build_labels(name)},
            "data": {"job.yaml": dump_config(cfg)}}


def build_service_account(name: str, overlay: Overlay) -> dict:
    # No token for whoever uses it, by default; the head mounts one into the autoscaler only.
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": overlay.service_account, "labels": {"app.kubernetes.io/name": "eft"}},
            "automountServiceAccountToken": False}


def build_manifests(cfg: JobConfig, overlay_name: Optional[str], image: Optional[str],
                    node_type: Optional[str] = None) -> dict[str, dict]:
    """file name → manifest. Raises ConfigError (one line, naming the field) if it cannot be placed."""
    overlay = resolve_overlay(overlay_name)
    if not image:
        raise ConfigError("--image: required (a container image with eft installed, pinned by tag)")
    if problem := check_image(image):
        raise ConfigError(f"--image: {problem}")
    place = plan_placement(cfg, resolve_node_type(cfg, overlay, node_type))
    name = build_kube_name(cfg)
    labels = build_labels(name)
    annotations = {"eft/run-uri": cfg.run_uri}
    config_map = build_config_map(cfg, name)
    job_labels = dict(labels, **({KUEUE_QUEUE_LABEL: overlay.queue} if overlay.queue else {}))
    job_spec = {
        # A retry may start while the last attempt's driver is still alive, or dead with its run
        # lease not yet expired: it waits for the lease (up to two lifetimes) instead of
        # failing, and never trains beside that driver (app.lease).
        "entrypoint": f"{ENTRYPOINT} --wait --wait-timeout-s {lease_wait_s(cfg)}",
        "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": 600,
        # A retry gets a fresh cluster; the same run name resumes from its last S3 checkpoint.
        "backoffLimit": 3,
        "activeDeadlineSeconds": 3 * ONE_DAY_S,
        "rayClusterSpec": build_cluster_spec(cfg, overlay, image, place),
        "submitterPodTemplate": build_submitter_template(name, overlay, image),
    }
    if overlay.queue:
        job_spec["suspend"] = True  # Kueue admits the whole gang, then unsuspends
    ray_job = {"apiVersion": "ray.io/v1", "kind": "RayJob",
               "metadata": {"name": name, "labels": job_labels, "annotations": annotations}, "spec": job_spec}
    cluster_spec = build_cluster_spec(cfg, overlay, image, place)
    cluster_spec["suspend"] = True  # a standing cluster for `ray job submit`; resume it by hand
    ray_cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
                   "metadata": {"name": name, "labels": labels, "annotations": annotations}, "spec": cluster_spec}
    manifests = {"configmap.yaml": config_map, "rayjob.yaml": ray_job, "raycluster.yaml": ray_cluster,
                 "serviceaccount.yaml": build_service_account(name, overlay),
                 "networkpolicy.yaml": build_network_policy(name),
                 "poddisruptionbudget.yaml": build_head_disruption_budget(name)}
    if cfg.eval is not None:
        manifests["rayjob-eval.yaml"] = build_eval_job(ray_job, name)
    return manifests


def build_eval_job(ray_job: dict, name: str) -> dict:
    """`eft eval` of the run's latest checkpoint on a cluster of the training job's shape (its GPU
    workers hold the eval actors): submit it after training, or beside it for an interim score.
    Results are committed last, so a retry simply scores again."""
    job = copy.deepcopy(ray_job)
    job["metadata"]["name"] = f"{name}-eval"
    spec = job["spec"]
    spec.update(entrypoint=EVAL_ENTRYPOINT, backoffLimit=1, activeDeadlineSeconds=ONE_DAY_S)
    return job


def dump_manifest(doc: dict) -> str:
    return yaml.safe_dump(doc, sort_keys=False, width=120)


def write_manifests(manifests: dict[str, dict], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for file_name, doc in manifests.items():
        path = out / file_name
        path.write_text(dump_manifest(doc))
        paths.append(path)
    return paths
