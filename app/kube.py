"""KubeRay manifests derived from a job config, and a validator as strict as the API server.

`build_manifests` turns a `JobConfig` into a ConfigMap (the resolved job.yaml), a RayJob that
creates its own cluster and runs `eft train /config/job.yaml`, and a standing RayCluster for
interactive `ray job submit` (created suspended, so applying a directory starts one cluster,
not two). The job config is the one source of truth: worker group sizes, GPUs, the run name
and the storage URI all come from it.

`check_documents` validates manifests against the KubeRay CRDs' openAPIV3Schema with unknown
fields as errors (like `kubectl apply --validate=strict`), plus the policy rules every
manifest must keep (head off spot, drain timing, pinned images, no literal credentials...).
Each problem is a `Violation`: `<manifest>: <field path>: <message>`.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml

from app.config import ConfigError, JobConfig, build_config, dump_config

REPO_ROOT = Path(__file__).resolve().parents[1]
# Vendored KubeRay v1.7.0 CRDs, shipped as package data (see kuberay_crds/README.md).
DEFAULT_CRD_DIR = Path(__file__).resolve().parent / "kuberay_crds"
CRD_FILES = ("ray.io_rayclusters.yaml", "ray.io_rayjobs.yaml")

RAY_VERSION = "2.60.0"
CONFIG_MOUNT = "/config"
ENTRYPOINT = f"eft train {CONFIG_MOUNT}/job.yaml"
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


@dataclass(frozen=True)
class NodeType:
    name: str
    provider: str  # "aws" or "gcp"
    gpus: int
    gpu: str
    # What a pod may request on the node: allocatable minus kubelet, system and DaemonSet reserve.
    cpus: int
    memory_gib: int


NODE_TYPES = {n.name: n for n in [
    NodeType("p4d.24xlarge", "aws", 8, "A100-40GB", 92, 1050),
    NodeType("p4de.24xlarge", "aws", 8, "A100-80GB", 92, 1050),
    NodeType("p5.48xlarge", "aws", 8, "H100-80GB", 188, 1900),
    NodeType("g5.48xlarge", "aws", 8, "A10G-24GB", 188, 700),
    NodeType("g5.12xlarge", "aws", 4, "A10G-24GB", 44, 170),
    NodeType("m6i.2xlarge", "aws", 0, "", 7, 26),
    NodeType("a3-highgpu-8g", "gcp", 8, "H100-80GB", 200, 1700),
    NodeType("a2-highgpu-8g", "gcp", 8, "A100-40GB", 92, 600),
    NodeType("a2-ultragpu-8g", "gcp", 8, "A100-80GB", 92, 1200),
    NodeType("g2-standard-48", "gcp", 4, "L4-24GB", 44, 170),
    NodeType("n2-standard-8", "gcp", 0, "", 7, 26),
]}


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
    service_account: Optional[str] = None
    queue: Optional[str] = None


OVERLAYS = {o.name: o for o in [
    Overlay("base", None, False, "p4d.24xlarge", "m6i.2xlarge", 90, 120),
    Overlay("eks-spot", "aws", True, "p4d.24xlarge", "m6i.2xlarge", 90, 110, service_account="eft"),
    Overlay("gke-spot", "gcp", True, "a3-highgpu-8g", "n2-standard-8", 15, 25, service_account="eft"),
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


@dataclass(frozen=True)
class Violation:
    manifest: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.manifest}: {self.field}: {self.message}"


# ----------------------------------------------------------------------------- rendering


def resolve_overlay(name: Optional[str]) -> Overlay:
    if name not in OVERLAYS:
        raise ConfigError(f"--overlay: unknown overlay {name!r} (choose one of {', '.join(OVERLAYS)})")
    return OVERLAYS[name]


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
    """Why an image reference is not pinned, or None. A digest pins; so does any tag but latest."""
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
    name = re.sub(r"[^a-z0-9-]", "-", cfg.name.lower()).strip("-")
    # KubeRay derives Service names (<name>-head-svc, RayJob suffixes) that must stay under 63.
    if not name or len(name) > 40:
        raise ConfigError(f"name: {cfg.name!r} must give a Kubernetes name of 1..40 characters")
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


def build_env(cfg: JobConfig, overlay: Overlay) -> list[dict]:
    env = [{"name": DRAIN_ENV, "value": str(overlay.drain_timeout_s)},
           {"name": "AWS_DEFAULT_REGION", "value": cfg.storage.s3_region},
           {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"}]
    if overlay.provider == "gcp":
        # The app speaks S3; on GKE that is GCS's S3 API with HMAC keys kept in a Secret.
        env += [{"name": key, "valueFrom": {"secretKeyRef": {"name": "eft-s3-hmac", "key": key, "optional": True}}}
                for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")]
    if cfg.storage.s3_endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": cfg.storage.s3_endpoint})
    return env


def build_resources(cpus: int, memory_gib: int, gpus: int) -> dict:
    # requests == limits: Guaranteed QoS, and the device plugin demands equal GPU counts anyway.
    amounts = {"cpu": str(cpus), "memory": f"{memory_gib}Gi"}
    if gpus:
        amounts[GPU_RESOURCE] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def build_pod_template(cfg: JobConfig, overlay: Overlay, image: str, *, head: bool, resources: dict,
                       config_map: str, shm_gib: int, extra: dict) -> dict:
    container = {
        "name": "ray-head" if head else "ray-worker",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "env": build_env(cfg, overlay),
        "resources": resources,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "job-config", "mountPath": CONFIG_MOUNT, "readOnly": True}],
    }
    if head:
        container["ports"] = [{"name": "gcs", "containerPort": 6379}, {"name": "dashboard", "containerPort": 8265},
                              {"name": "client", "containerPort": 10001}]
    spec = {
        "terminationGracePeriodSeconds": overlay.grace_period_s,
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gib}Gi"}},
                    {"name": "job-config", "configMap": {"name": config_map}}],
        **extra,
    }
    if overlay.service_account:
        spec["serviceAccountName"] = overlay.service_account
    annotations = {SAFE_TO_EVICT: "false", "karpenter.sh/do-not-disrupt": "true"} if head else {}
    meta = {"labels": {"app.kubernetes.io/name": "eft", "eft/run": build_kube_name(cfg)}}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": spec}


def build_cluster_spec(cfg: JobConfig, overlay: Overlay, image: str, place: Placement) -> dict:
    config_map = f"{build_kube_name(cfg)}-config"
    head = build_pod_template(cfg, overlay, image, head=True, resources=build_resources(4, 16, 0),
                              config_map=config_map, shm_gib=4, extra={"affinity": build_head_affinity()})
    extra: dict[str, Any] = {"restartPolicy": "Never"}  # autoscaler v2 replaces failed worker pods itself
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
    worker = build_pod_template(cfg, overlay, image, head=False,
                                resources=build_resources(place.pod_cpus, place.pod_memory_gib, place.pod_gpus),
                                config_map=config_map, shm_gib=max(1, place.pod_memory_gib // 3), extra=extra)
    group = "gpu-workers" if place.pod_gpus else "cpu-workers"
    return {
        "rayVersion": RAY_VERSION,
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {"version": "v2", "idleTimeoutSeconds": 120, "upscalingMode": "Default"},
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
    labels = {"app.kubernetes.io/name": "eft", "eft/run": name}
    annotations = {"eft/run-uri": cfg.run_uri}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": f"{name}-config", "labels": labels},
                  "data": {"job.yaml": dump_config(cfg)}}
    job_labels = dict(labels, **({KUEUE_QUEUE_LABEL: overlay.queue} if overlay.queue else {}))
    job_spec = {
        "entrypoint": ENTRYPOINT,
        "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": 600,
        # A retry gets a fresh cluster; the same run name resumes from its last S3 checkpoint.
        "backoffLimit": 3,
        "activeDeadlineSeconds": 3 * ONE_DAY_S,
        "rayClusterSpec": build_cluster_spec(cfg, overlay, image, place),
    }
    if overlay.queue:
        job_spec["suspend"] = True  # Kueue admits the whole gang, then unsuspends
    ray_job = {"apiVersion": "ray.io/v1", "kind": "RayJob",
               "metadata": {"name": name, "labels": job_labels, "annotations": annotations}, "spec": job_spec}
    cluster_spec = build_cluster_spec(cfg, overlay, image, place)
    cluster_spec["suspend"] = True  # a standing cluster for `ray job submit`; resume it by hand
    ray_cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
                   "metadata": {"name": name, "labels": labels, "annotations": annotations}, "spec": cluster_spec}
    return {"configmap.yaml": config_map, "rayjob.yaml": ray_job, "raycluster.yaml": ray_cluster}


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


# ----------------------------------------------------------------------------- kustomize tree

BASE_CONFIG = REPO_ROOT / "jobs" / "configs" / "tiny-cpu.yaml"
BASE_IMAGE = "registry.example.com/eft:0.1.0"
KUSTOMIZE_OVERLAYS = ("eks-spot", "gke-spot", "kueue")


def diff_to_patch(old: Any, new: Any, path: str = "") -> list[dict]:
    """JSON6902 ops turning `old` into `new`: descends into mappings and same-length lists,
    replaces anything else whole."""
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        pairs = enumerate(zip(old, new, strict=True))
        return [op for i, (a, b) in pairs if a != b for op in diff_to_patch(a, b, f"{path}/{i}")]
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [{"op": "replace", "path": path, "value": new}]
    ops = []
    for key in new:
        sub = f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"
        if key not in old:
            ops.append({"op": "add", "path": sub, "value": new[key]})
        elif old[key] != new[key]:
            ops += diff_to_patch(old[key], new[key], sub)
    ops += [{"op": "remove", "path": f"{path}/{str(k).replace('~', '~0').replace('/', '~1')}"}
            for k in old if k not in new]
    return ops


def build_kustomize_tree(config_path: str | Path = BASE_CONFIG, image: str = BASE_IMAGE) -> dict[str, str]:
    """relative path → file text for kuberay/: the base rendered from the config, and each overlay
    as JSON patches against it (so the overlays never drift from what `eft manifests` renders)."""
    from app.config import load_config

    cfg = load_config(config_path)
    base = build_manifests(cfg, "base", image)
    header = f"# Generated by app.kube.write_kustomize_tree from {Path(config_path).name}; do not edit.\n"
    tree = {f"base/{name}": header + dump_manifest(doc) for name, doc in base.items()}
    tree["base/kustomization.yaml"] = header + dump_manifest({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": list(base)})
    for overlay in KUSTOMIZE_OVERLAYS:
        rendered = build_manifests(cfg, overlay, image)
        patches = []
        for file_name in ("rayjob.yaml", "raycluster.yaml"):
            doc = base[file_name]
            ops = diff_to_patch(doc, rendered[file_name])
            patch_file = file_name.replace(".yaml", "-patch.yaml")
            tree[f"overlays/{overlay}/{patch_file}"] = header + dump_manifest(ops)
            patches.append({"path": patch_file, "target": {"kind": doc["kind"], "name": doc["metadata"]["name"]}})
        tree[f"overlays/{overlay}/kustomization.yaml"] = header + dump_manifest({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": ["../../base"], "patches": patches})
    return tree


def write_kustomize_tree(root: str | Path = REPO_ROOT / "kuberay") -> None:
    for rel, text in build_kustomize_tree().items():
        path = Path(root) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# ----------------------------------------------------------------------------- schema validation

# Top-level ObjectMeta is validated by the API server itself, not by the CRD; these are its
# fields a manifest may set.
OBJECT_META = {"type": "object", "additionalProperties": False, "properties": {
    "name": {"type": "string"}, "generateName": {"type": "string"}, "namespace": {"type": "string"},
    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    "finalizers": {"type": "array", "items": {"type": "string"}},
    "ownerReferences": {"type": "array", "items": {"type": "object"}},
}}
CONFIG_MAP_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata"],
                     "properties": {
                         "apiVersion": {"enum": ["v1"]}, "kind": {"enum": ["ConfigMap"]}, "metadata": OBJECT_META,
                         "data": {"type": "object", "additionalProperties": {"type": "string"}},
                         "binaryData": {"type": "object", "additionalProperties": {"type": "string"}},
                         "immutable": {"type": "boolean"}}}


def strict_schema(node: Any) -> Any:
    """An OpenAPI v3 CRD schema as JSON Schema with unknown fields as errors: structural objects
    without preserve-unknown-fields get additionalProperties false (the API server would prune or,
    with --validate=strict, reject them); nullable and int-or-string become JSON Schema."""
    if isinstance(node, list):
        return [strict_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_schema(v) for k, v in node.items()
           if k not in ("x-kubernetes-validations", "properties", "additionalProperties")}
    if "properties" in node:
        out["properties"] = {k: strict_schema(v) for k, v in node["properties"].items()}
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = strict_schema(node["additionalProperties"])
    elif node.get("type") == "object" and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = bool(node.get("additionalProperties", False))
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def load_schemas(crd_dir: str | Path | None = None) -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) → strict JSON Schema, from the KubeRay CRDs plus a built-in ConfigMap."""
    return _load_schemas(Path(crd_dir or DEFAULT_CRD_DIR).resolve())


@functools.lru_cache(maxsize=4)  # the CRDs are 2 MB of YAML; parse them once per process
def _load_schemas(crd_dir: Path) -> dict[tuple[str, str], dict]:
    if not crd_dir.is_dir():
        raise ConfigError(f"--crd-dir: {crd_dir}: KubeRay CRD directory not found "
                          f"(expected {', '.join(CRD_FILES)})")
    schemas = {("v1", "ConfigMap"): CONFIG_MAP_SCHEMA}
    for file_name in CRD_FILES:
        path = crd_dir / file_name
        if not path.is_file():
            raise ConfigError(f"--crd-dir: {path}: CRD file not found")
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if not version.get("served"):
                continue
            schema = strict_schema(version["schema"]["openAPIV3Schema"])
            schema["properties"]["metadata"] = OBJECT_META
            schema["properties"]["apiVersion"] = {"enum": [f"{group}/{version['name']}"]}
            schema["properties"]["kind"] = {"enum": [kind]}
            schema["properties"].pop("status", None)
            schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
            schemas[(f"{group}/{version['name']}", kind)] = schema
    return schemas


def format_path(parts) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z0-9_-]+", str(part)):
            out += f".{part}" if out else str(part)
        else:
            out += f"[{json.dumps(part)}]"
    return out or "<root>"


def describe_schema_error(err) -> Iterator[tuple[str, str]]:
    path = list(err.absolute_path)
    if err.validator == "additionalProperties" and err.validator_value is False:
        known = set(err.schema.get("properties", {}))
        for key in sorted(set(err.instance) - known):
            yield format_path(path + [key]), "unknown field"
    elif err.validator == "required":
        missing = re.match(r"'([^']+)'", err.message)
        yield format_path(path + [missing.group(1) if missing else "?"]), "required field missing"
    elif err.validator == "enum":
        yield format_path(path), f"{err.instance!r} is not one of {err.validator_value}"
    else:
        yield format_path(path), err.message


def check_schema(doc: Any, schemas: dict, manifest: str) -> list[Violation]:
    from jsonschema import Draft202012Validator, FormatChecker

    if not isinstance(doc, dict):
        return [Violation(manifest, "<root>", "not a mapping")]
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in schemas:
        return [Violation(manifest, "kind", f"unknown apiVersion/kind {key[0]}/{key[1]}")]
    checker = FormatChecker()
    checker.checks("int32")(lambda v: not isinstance(v, int) or -2**31 <= v < 2**31)
    validator = Draft202012Validator(schemas[key], format_checker=checker)
    out = []
    for err in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
        out += [Violation(manifest, field, msg) for field, msg in describe_schema_error(err)]
    return out


# ----------------------------------------------------------------------------- policy checks

SECRET_NAME = re.compile(r"SECRET|PASSWORD|TOKEN|ACCESS_KEY|API_KEY|CREDENTIAL|PRIVATE_KEY", re.I)
AWS_KEY_ID = re.compile(r"(?<![A-Z0-9])(AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])")


def get(node: Any, *keys, default=None):
    for key in keys:
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
        else:
            return default
    return node


def iter_strings(node: Any, path: tuple = ()) -> Iterator[tuple[tuple, str]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from iter_strings(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from iter_strings(v, path + (i,))
    elif isinstance(node, str):
        yield path, node


def find_spot_selectors(pod_spec: dict) -> list[tuple[str, str]]:
    """(field, label key) for each way a pod spec asks for spot nodes: a nodeSelector entry or a
    required node-affinity `In`."""
    found = [("nodeSelector", k) for k, v in (pod_spec.get("nodeSelector") or {}).items() if SPOT_LABELS.get(k) == v]
    terms = get(pod_spec, "affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution",
                "nodeSelectorTerms", default=[]) or []
    for term in terms:
        for expr in term.get("matchExpressions") or []:
            if expr.get("operator") == "In" and SPOT_LABELS.get(expr.get("key")) in (expr.get("values") or []):
                found.append(("affinity", expr["key"]))
    return found


def selects_spot(pod_spec: dict) -> list[str]:
    return sorted({key for _, key in find_spot_selectors(pod_spec)})


def tolerates(pod_spec: dict, key: str) -> bool:
    return any(t.get("key") == key or (not t.get("key") and t.get("operator") == "Exists")
               for t in pod_spec.get("tolerations") or [])


def term_excludes_spot(term: dict) -> bool:
    exprs = term.get("matchExpressions") or []
    for expr in exprs:
        spot = SPOT_LABELS.get(expr.get("key"))
        if spot and expr.get("operator") == "In" and spot not in (expr.get("values") or []):
            return True  # restricted to nodes labelled with a non-spot capacity type
    return all(any(e.get("key") == key and (e.get("operator") == "DoesNotExist" or
                                             (e.get("operator") == "NotIn" and value in (e.get("values") or [])))
                   for e in exprs)
               for key, value in SPOT_LABELS.items())


def check_head_off_spot(pod_spec: dict, at: str) -> list[tuple[str, str]]:
    out = []
    for field, key in find_spot_selectors(pod_spec):
        out.append((f"{at}.{field}", f"head pod selects spot nodes ({key})"))
    for i, tol in enumerate(pod_spec.get("tolerations") or []):
        if tol.get("key") in SPOT_LABELS or (not tol.get("key") and tol.get("operator") == "Exists"):
            out.append((f"{at}.tolerations[{i}]", "head pod tolerates the spot taint"))
    terms = get(pod_spec, "affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution",
                "nodeSelectorTerms", default=None)
    if not terms or not all(term_excludes_spot(t) for t in terms):
        out.append((f"{at}.affinity.nodeAffinity", "head pod must require non-spot nodes "
                                                    f"(NotIn spot for {', '.join(SPOT_LABELS)})"))
    return out


def check_container(c: dict, at: str) -> list[tuple[str, str]]:
    out = []
    if problem := check_image(c.get("image")):
        out.append((f"{at}.image", problem))
    requests = get(c, "resources", "requests", default={}) or {}
    limits = get(c, "resources", "limits", default={}) or {}
    for res in sorted(set(requests) | set(limits)):
        if "gpu" in res and str(requests.get(res)) != str(limits.get(res)):
            out.append((f"{at}.resources", f"{res} requests ({requests.get(res)}) != limits ({limits.get(res)})"))
    for i, env in enumerate(c.get("env") or []):
        if SECRET_NAME.search(env.get("name", "")) and "value" in env:
            out.append((f"{at}.env[{i}].value", f"{env['name']} is a literal credential; use a secretKeyRef "
                                                "or a service account"))
    return out


def check_pod(pod: dict, at: str, *, ray: bool) -> list[tuple[str, str]]:
    spec = pod.get("spec") or {}
    out = []
    containers = spec.get("containers") or []
    for i, c in enumerate(containers):
        out += check_container(c, f"{at}.spec.containers[{i}]")
    for i, c in enumerate(spec.get("initContainers") or []):
        out += check_container(c, f"{at}.spec.initContainers[{i}]")
    if not ray or not containers:
        return out
    main = containers[0]
    shm_volumes = {v.get("name") for v in spec.get("volumes") or [] if get(v, "emptyDir", "medium") == "Memory"}
    if not any(m.get("mountPath") == "/dev/shm" and m.get("name") in shm_volumes for m in main.get("volumeMounts")
               or []):
        out.append((f"{at}.spec.volumes", "/dev/shm must be a memory emptyDir mounted in the Ray container"))
    drain = next((e.get("value") for e in main.get("env") or [] if e.get("name") == DRAIN_ENV), None)
    grace = spec.get("terminationGracePeriodSeconds")
    if drain is None or not str(drain).isdigit():
        out.append((f"{at}.spec.containers[0].env", f"{DRAIN_ENV} must be set to a whole number of seconds"))
    elif not isinstance(grace, int) or grace <= int(drain):
        out.append((f"{at}.spec.terminationGracePeriodSeconds",
                    f"{grace} must be longer than {DRAIN_ENV} ({drain}) so a reclaimed node drains"))
    return out


def check_cluster_spec(spec: dict, at: str) -> list[tuple[str, str]]:
    out = []
    head = get(spec, "headGroupSpec", default={}) or {}
    if get(head, "rayStartParams", "num-cpus") != "0":
        out.append((f"{at}.headGroupSpec.rayStartParams", 'num-cpus must be "0" (no work on the head)'))
    head_tpl = head.get("template") or {}
    out += check_pod(head_tpl, f"{at}.headGroupSpec.template", ray=True)
    out += check_head_off_spot(head_tpl.get("spec") or {}, f"{at}.headGroupSpec.template.spec")
    if get(head_tpl, "metadata", "annotations", SAFE_TO_EVICT) != "false":
        out.append((f"{at}.headGroupSpec.template.metadata.annotations", f'{SAFE_TO_EVICT} must be "false"'))
    if spec.get("enableInTreeAutoscaling") is not True:
        out.append((f"{at}.enableInTreeAutoscaling", "must be true"))
    if get(spec, "autoscalerOptions", "version") != "v2":
        out.append((f"{at}.autoscalerOptions.version", 'must be "v2"'))
    if not isinstance(get(spec, "autoscalerOptions", "idleTimeoutSeconds"), int) or \
            get(spec, "autoscalerOptions", "idleTimeoutSeconds") <= 0:
        out.append((f"{at}.autoscalerOptions.idleTimeoutSeconds", "an idle timeout must be set"))
    autoscaler_image = get(spec, "autoscalerOptions", "image")
    if autoscaler_image and (problem := check_image(autoscaler_image)):
        out.append((f"{at}.autoscalerOptions.image", problem))
    groups = spec.get("workerGroupSpecs") or []
    if not groups:
        out.append((f"{at}.workerGroupSpecs", "at least one worker group is needed"))
    for i, group in enumerate(groups):
        gat = f"{at}.workerGroupSpecs[{i}]"
        lo, hi = group.get("minReplicas"), group.get("maxReplicas")
        if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
            out.append((f"{gat}.minReplicas", f"{lo} > maxReplicas ({hi})"))
        tpl = group.get("template") or {}
        out += check_pod(tpl, f"{gat}.template", ray=True)
        pod_spec = tpl.get("spec") or {}
        for key in selects_spot(pod_spec):
            if not tolerates(pod_spec, key):
                out.append((f"{gat}.template.spec.tolerations", f"selects spot nodes ({key}) but does not "
                                                                f"tolerate the spot taint"))
    return out


def check_ray_job(doc: dict) -> list[tuple[str, str]]:
    spec = doc.get("spec") or {}
    out = []
    if not str(spec.get("entrypoint", "")).startswith(ENTRYPOINT):
        out.append(("spec.entrypoint", f"must run {ENTRYPOINT!r}"))
    if spec.get("submissionMode", "K8sJobMode") != "K8sJobMode":
        out.append(("spec.submissionMode", "must be K8sJobMode"))
    if spec.get("shutdownAfterJobFinishes") is not True:
        out.append(("spec.shutdownAfterJobFinishes", "must be true"))
    for key, least in (("ttlSecondsAfterFinished", 0), ("backoffLimit", 1), ("activeDeadlineSeconds", 1)):
        value = spec.get(key)
        if not isinstance(value, int) or value < least:
            out.append((f"spec.{key}", f"must be set to an integer >= {least}"))
    if "rayClusterSpec" not in spec:
        out.append(("spec.rayClusterSpec", "the RayJob must create its own cluster (retries get a fresh one)"))
    else:
        out += check_cluster_spec(spec["rayClusterSpec"], "spec.rayClusterSpec")
        head_mounts = get(spec, "rayClusterSpec", "headGroupSpec", "template", "spec", "containers", 0,
                          "volumeMounts", default=[]) or []
        if not any(m.get("mountPath") == CONFIG_MOUNT for m in head_mounts):
            out.append(("spec.rayClusterSpec.headGroupSpec.template.spec.containers[0].volumeMounts",
                        f"the job config must be mounted at {CONFIG_MOUNT}"))
    if KUEUE_QUEUE_LABEL in (get(doc, "metadata", "labels", default={}) or {}) and spec.get("suspend") is not True:
        out.append(("spec.suspend", "must be true under Kueue (it unsuspends the job on admission)"))
    if spec.get("submitterPodTemplate"):
        out += check_pod(spec["submitterPodTemplate"], "spec.submitterPodTemplate", ray=False)
    return out


def check_policy(doc: dict) -> list[tuple[str, str]]:
    out = [(format_path(path), "looks like a literal AWS access key id; use a service account or a secretKeyRef")
           for path, text in iter_strings(doc) if AWS_KEY_ID.search(text)]
    if doc.get("kind") == "RayCluster":
        out += check_cluster_spec(doc.get("spec") or {}, "spec")
    elif doc.get("kind") == "RayJob":
        out += check_ray_job(doc)
    return out


def parse_config_map_job(doc: dict, manifest: str) -> tuple[Optional[JobConfig], list[Violation]]:
    text = get(doc, "data", "job.yaml")
    if text is None:
        return None, []
    try:
        return build_config(yaml.safe_load(text) or {}, "job.yaml"), []
    except (ConfigError, yaml.YAMLError) as err:
        return None, [Violation(manifest, 'data["job.yaml"]', str(err).splitlines()[0])]


def check_against_config(doc: dict, cfg: JobConfig, at: str) -> list[tuple[str, str]]:
    """The worker group must be the job config's scaling, in pods (GPUs per pod / GPUs per worker)."""
    s = cfg.scaling
    out = []
    for i, group in enumerate(get(doc, *at.split("."), "workerGroupSpecs", default=[]) or []):
        limits = get(group, "template", "spec", "containers", 0, "resources", "limits", default={}) or {}
        gpus = float(str(limits.get(GPU_RESOURCE, 0)))
        per_pod = gpus / s.gpus_per_worker if s.use_gpu else 1
        for key, field in (("minReplicas", "min_workers"), ("maxReplicas", "max_workers")):
            count = getattr(s, field)
            if not per_pod or group.get(key) != count / per_pod:
                out.append((f"{at}.workerGroupSpecs[{i}].{key}",
                            f"{group.get(key)} does not match scaling.{field} ({count}) at {per_pod:g} per pod"))
    return out


def check_documents(docs: list[tuple[str, Any]], schemas: dict) -> list[Violation]:
    """Schema + policy for each (manifest label, document), then each Ray manifest against the
    job config of the ConfigMap it mounts, when that ConfigMap is among the documents."""
    out: list[Violation] = []
    configs: dict[str, JobConfig] = {}
    for manifest, doc in docs:
        out += check_schema(doc, schemas, manifest)
        if not isinstance(doc, dict):
            continue
        out += [Violation(manifest, f, m) for f, m in check_policy(doc)]
        if doc.get("kind") == "ConfigMap":
            cfg, bad = parse_config_map_job(doc, manifest)
            out += bad
            if cfg is not None:
                configs[get(doc, "metadata", "name", default="")] = cfg
    for manifest, doc in docs:
        if not isinstance(doc, dict) or doc.get("kind") not in ("RayCluster", "RayJob"):
            continue
        at = "spec.rayClusterSpec" if doc["kind"] == "RayJob" else "spec"
        volumes = get(doc, *at.split("."), "headGroupSpec", "template", "spec", "volumes", default=[]) or []
        for volume in volumes:
            cfg = configs.get(get(volume, "configMap", "name", default=None))
            if cfg is not None:
                out += [Violation(manifest, f, m) for f, m in check_against_config(doc, cfg, at)]
    return out


def load_documents(target: str | Path) -> list[tuple[str, Any]]:
    """(label, document) for every YAML document under a file or directory. Kustomization files
    are not manifests and are skipped; a multi-document file labels each `file#Kind/name`."""
    target = Path(target)
    if not target.exists():
        raise ConfigError(f"--check: {target}: no such file or directory")
    files = [target] if target.is_file() else sorted(p for p in target.rglob("*") if p.suffix in (".yaml", ".yml"))
    docs = []
    for path in files:
        if path.name in ("kustomization.yaml", "kustomization.yml"):
            continue
        try:
            found = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        except yaml.YAMLError as err:
            docs.append((str(path), f"not valid YAML ({str(err).splitlines()[0]})"))
            continue
        for doc in found:
            label = str(path)
            if len(found) > 1 and isinstance(doc, dict):
                label = f"{path}#{doc.get('kind')}/{get(doc, 'metadata', 'name')}"
            docs.append((label, doc))
    return docs


def check_path(target: str | Path, crd_dir: str | Path | None = None) -> tuple[int, list[Violation]]:
    """(documents checked, violations) for a manifest file or directory."""
    schemas = load_schemas(crd_dir)
    docs = load_documents(target)
    if not docs:
        raise ConfigError(f"--check: {target}: no YAML manifests found")
    out = [Violation(label, "<root>", doc) for label, doc in docs if isinstance(doc, str)]
    out += check_documents([(label, doc) for label, doc in docs if not isinstance(doc, str)], schemas)
    return len(docs), out


def render_checked(cfg: JobConfig, overlay: Optional[str], image: Optional[str], node_type: Optional[str],
                   crd_dir: str | Path | None = None) -> dict[str, dict]:
    """build_manifests, refusing to hand out anything the validator would reject."""
    manifests = build_manifests(cfg, overlay, image, node_type)
    problems = check_documents(list(manifests.items()), load_schemas(crd_dir))
    if problems:
        raise ValueError(f"rendered manifests fail validation: {problems[0]}")
    return manifests

