"""The rules every manifest must keep beyond its schema (token auth, non-root hardened
containers, a dedicated service account, head off spot, drain timing, pinned images, no
literal credentials...), each Ray manifest checked against the job config it mounts, and
`render_checked`, which refuses to hand out anything the checks reject.

A finding is `(field, message)` (an error) or `(field, message, WARNING)`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml

from app.config import ConfigError, JobConfig, build_config
from app.kube.fabric import EFA_RESOURCE, NODE_TYPE_ANNOTATION, needs_fabric
from app.kube.render import (API_TOKEN_MOUNT, CONFIG_MOUNT, DRAIN_ENV, ENTRYPOINT, EVAL_ENTRYPOINT, GPU_RESOURCE,
                             HEAD_CLIENT_PORTS, KUEUE_QUEUE_LABEL, RUN_LABEL, SAFE_TO_EVICT, SPOT_LABELS, TMP_MOUNT,
                             build_manifests, check_image, warn_image)
from app.kube.schema import ERROR, WARNING, Violation, check_schema, format_path, load_schemas
from app.kube.service import SERVE_CLIENT_LABEL, SERVE_PORT, build_service_manifests
from app.nodes import DAEMONS, FABRICS, NODE_TYPES, Fabric

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


def check_security_context(c: dict, pod_context: dict, at: str, allowed_caps: tuple = (),
                           root_allowed: bool = False) -> list[tuple]:
    """The hardening every container keeps: the container's own securityContext, falling back to
    the pod's for the two fields Kubernetes inherits (runAsNonRoot, seccompProfile). A fabric's
    containers may add exactly the capabilities it needs, and its RxDM daemon may run as root."""
    ctx = c.get("securityContext") or {}
    at = f"{at}.securityContext"
    out = []
    if not root_allowed:
        if ctx.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is not True:
            out.append((f"{at}.runAsNonRoot", "must be true (containers run as a non-root user)"))
        if ctx.get("runAsUser", pod_context.get("runAsUser")) == 0:
            out.append((f"{at}.runAsUser", "0 runs as root"))
    if ctx.get("privileged") is True:
        out.append((f"{at}.privileged", "must not be true"))
    if ctx.get("allowPrivilegeEscalation") is not False:
        out.append((f"{at}.allowPrivilegeEscalation", "must be false"))
    if "ALL" not in (get(ctx, "capabilities", "drop", default=[]) or []):
        out.append((f"{at}.capabilities.drop", 'must drop ["ALL"]'))
    extra = [cap for cap in get(ctx, "capabilities", "add", default=[]) or []
             if cap.removeprefix("CAP_") not in allowed_caps]
    if extra:
        allowed = f" beyond its fabric's {list(allowed_caps)}" if allowed_caps else ""
        out.append((f"{at}.capabilities.add", f"must add no capabilities{allowed} (adds {extra})"))
    seccomp = get(ctx, "seccompProfile", "type", default=get(pod_context, "seccompProfile", "type"))
    if seccomp not in ("RuntimeDefault", "Localhost"):
        out.append((f"{at}.seccompProfile.type", f"{seccomp!r} must be RuntimeDefault (or Localhost)"))
    return out


def image_repo(image: Optional[str]) -> str:
    name = (image or "").split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name.rsplit(":", 1)[0] if ":" in last else name


def find_pod_fabric(spec: dict) -> Optional[Fabric]:
    """The fabric a pod uses: EFA devices requested by its Ray container, or a GPUDirect RxDM
    daemon sidecar running Google's image."""
    containers = spec.get("containers") or []
    requests = get(containers, 0, "resources", "requests", default={}) or {}
    if EFA_RESOURCE in requests:
        return FABRICS["efa"]
    for c in containers[1:]:
        fabric = DAEMONS.get(c.get("name"))
        if fabric and image_repo(c.get("image")) == image_repo(fabric.daemon.image):
            return fabric
    return None


def describe_worker_fabric(manifests: dict[str, dict]) -> str:
    """One line for `eft manifests`: the fabric the worker pods use, or why they use none."""
    group = get(manifests["rayjob.yaml"], "spec", "rayClusterSpec", "workerGroupSpecs", 0, default={}) or {}
    node = NODE_TYPES.get(get(group, "template", "metadata", "annotations", NODE_TYPE_ANNOTATION))
    fabric = find_pod_fabric(get(group, "template", "spec", default={}) or {})
    nodes = f"up to {group.get('maxReplicas')} {node.name if node else '?'} node(s)"
    if fabric:
        return f"workers: {nodes} over {fabric.what}"
    if node is None or not node.gpus:
        return f"workers: {nodes}, CPU only: no GPU fabric"
    why = "the job fits one node (NVLink inside it)" if node.fabric else "the node type has no fast fabric"
    return f"workers: {nodes}, NCCL over TCP sockets between nodes: {why}"


def check_host_paths(spec: dict, fabric: Optional[Fabric], at: str) -> list[tuple]:
    """hostPath volumes expose the node: only the paths the pod's own fabric mounts are allowed."""
    allowed = set()
    if fabric:
        mounts = fabric.ray_host_mounts + (fabric.daemon.host_mounts if fabric.daemon else ())
        allowed = {host for _, host, _ in mounts}
    out = []
    for i, volume in enumerate(spec.get("volumes") or []):
        path = get(volume, "hostPath", "path")
        if "hostPath" in volume and path not in allowed:
            why = f"only its fabric's {sorted(allowed)}" if allowed else "no hostPath (the pod uses no fabric)"
            out.append((f"{at}.volumes[{i}].hostPath", f"{path!r}: a hostPath exposes the node; {why}"))
    return out


def check_worker_fabric(group: dict, at: str) -> list[tuple]:
    """A GPU group that spans nodes of a fabric node type must use that fabric, with all its
    devices: FSDP all-gathers the base across nodes every step, and NCCL over TCP sockets makes
    the job network-bound."""
    tpl = group.get("template") or {}
    spec = tpl.get("spec") or {}
    name = get(spec, "nodeSelector", "node.kubernetes.io/instance-type") or \
        get(tpl, "metadata", "annotations", NODE_TYPE_ANNOTATION)
    node = NODE_TYPES.get(name)
    limits = get(spec, "containers", 0, "resources", "limits", default={}) or {}
    gpus = float(str(limits.get("nvidia.com/gpu", 0)))
    replicas = group.get("maxReplicas") if isinstance(group.get("maxReplicas"), int) else 0
    want = needs_fabric(node, replicas, gpus) if node else None
    if want is None:
        return []
    have = find_pod_fabric(spec)
    if have is None or have.name != want.name:
        ask = f"request {EFA_RESOURCE}: {node.fabric_devices}" if want.name == "efa" else \
            f"add the {want.daemon.name} sidecar"
        return [(f"{at}.template.spec", f"up to {replicas} {name} nodes without their {want.name} fabric: NCCL "
                                        f"falls back to TCP sockets between nodes ({ask}; eft manifests renders it)")]
    devices = get(spec, "containers", 0, "resources", "limits", EFA_RESOURCE)
    if want.name == "efa" and str(devices) != str(node.fabric_devices):
        return [(f"{at}.template.spec.containers[0].resources.limits",
                 f"{EFA_RESOURCE} {devices} of the {node.fabric_devices} a {name} node has: NCCL maps GPUs to "
                 f"the devices it gets, so a partial request halves the bandwidth or worse")]
    return []


def check_container(c: dict, at: str, pod_context: dict, allowed_caps: tuple = (),
                    root_allowed: bool = False) -> list[tuple]:
    out = []
    if problem := check_image(c.get("image")):
        out.append((f"{at}.image", problem))
    elif problem := warn_image(c.get("image")):
        out.append((f"{at}.image", problem, WARNING))
    out += check_security_context(c, pod_context, at, allowed_caps, root_allowed)
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


def check_pod(pod: dict, at: str, *, ray: bool) -> list[tuple]:
    spec = pod.get("spec") or {}
    pod_context = spec.get("securityContext") or {}
    out = []
    account = spec.get("serviceAccountName") or spec.get("serviceAccount")
    if account in (None, "", "default"):
        out.append((f"{at}.spec.serviceAccountName", f"{account or 'unset'}: pods run as a dedicated service "
                                                     f"account, never 'default'"))
    if spec.get("automountServiceAccountToken") is not False:
        out.append((f"{at}.spec.automountServiceAccountToken", "must be false (only the autoscaler gets an API "
                                                               "token, through its own mount)"))
    if spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"):
        out.append((f"{at}.spec", "must not share the host's network, PID or IPC namespace"))
    containers = spec.get("containers") or []
    fabric = find_pod_fabric(spec) if ray else None
    for i, c in enumerate(containers):
        daemon = fabric.daemon if fabric and fabric.daemon and i and c.get("name") == fabric.daemon.name else None
        caps = daemon.capabilities if daemon else (fabric.capabilities if fabric and i == 0 else ())
        out += check_container(c, f"{at}.spec.containers[{i}]", pod_context, caps, root_allowed=daemon is not None)
    out += check_host_paths(spec, fabric, f"{at}.spec")
    for i, c in enumerate(spec.get("initContainers") or []):
        out += check_container(c, f"{at}.spec.initContainers[{i}]", pod_context)
    if not ray or not containers:
        return out
    main = containers[0]
    mounts = {m.get("mountPath"): m.get("name") for m in main.get("volumeMounts") or []}
    shm_volumes = {v.get("name") for v in spec.get("volumes") or [] if get(v, "emptyDir", "medium") == "Memory"}
    if mounts.get("/dev/shm") not in shm_volumes:
        out.append((f"{at}.spec.volumes", "/dev/shm must be a memory emptyDir mounted in the Ray container"))
    if get(main, "securityContext", "readOnlyRootFilesystem") is True and TMP_MOUNT not in mounts:
        out.append((f"{at}.spec.containers[0].volumeMounts", f"a read-only root needs a volume at {TMP_MOUNT} "
                                                             "(Ray writes its session dir and logs there)"))
    if API_TOKEN_MOUNT in mounts:
        out.append((f"{at}.spec.containers[0].volumeMounts", f"the Ray container must not mount the API token "
                                                             f"({API_TOKEN_MOUNT}); only the autoscaler does"))
    if "ephemeral-storage" not in (get(main, "resources", "requests", default={}) or {}):
        out.append((f"{at}.spec.containers[0].resources.requests", "ephemeral-storage must be requested "
                                                                   "(the model cache and Ray's logs)"))
    drain = next((e.get("value") for e in main.get("env") or [] if e.get("name") == DRAIN_ENV), None)
    grace = spec.get("terminationGracePeriodSeconds")
    if drain is None or not str(drain).isdigit():
        out.append((f"{at}.spec.containers[0].env", f"{DRAIN_ENV} must be set to a whole number of seconds"))
    elif not isinstance(grace, int) or grace <= int(drain):
        out.append((f"{at}.spec.terminationGracePeriodSeconds",
                    f"{grace} must be longer than {DRAIN_ENV} ({drain}) so a reclaimed node drains"))
    return out


def check_cluster_spec(spec: dict, at: str, training: bool = True) -> list[tuple]:
    """`training`: a worker group spanning nodes must have its fabric (serving replicas, each
    within a node, need none)."""
    out = []
    if get(spec, "authOptions", "mode") != "token":
        out.append((f"{at}.authOptions.mode", f"{get(spec, 'authOptions', 'mode')!r} must be 'token' (anyone who "
                                              "reaches the head could otherwise run code as the pods)"))
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
    autoscaler = spec.get("autoscalerOptions") or {}
    autoscaler_image = autoscaler.get("image")
    if autoscaler_image and (problem := check_image(autoscaler_image)):
        out.append((f"{at}.autoscalerOptions.image", problem))
    if spec.get("enableInTreeAutoscaling") is True:
        out += check_security_context(autoscaler, get(head_tpl, "spec", "securityContext", default={}) or {},
                                      f"{at}.autoscalerOptions")
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
        if training:
            out += check_worker_fabric(group, gat)
        pod_spec = tpl.get("spec") or {}
        for key in selects_spot(pod_spec):
            if not tolerates(pod_spec, key):
                out.append((f"{gat}.template.spec.tolerations", f"selects spot nodes ({key}) but does not "
                                                                f"tolerate the spot taint"))
    return out


def check_ray_job(doc: dict) -> list[tuple]:
    spec = doc.get("spec") or {}
    out = []
    if not str(spec.get("entrypoint", "")).startswith((ENTRYPOINT, EVAL_ENTRYPOINT)):
        out.append(("spec.entrypoint", f"must run {ENTRYPOINT!r} (or {EVAL_ENTRYPOINT!r})"))
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
    if spec.get("submissionMode", "K8sJobMode") == "K8sJobMode":
        # Left out, KubeRay's default submitter runs as root under the `default` account.
        if not spec.get("submitterPodTemplate"):
            out.append(("spec.submitterPodTemplate", "must be set (the default submitter pod is not hardened)"))
        else:
            out += check_pod(spec["submitterPodTemplate"], "spec.submitterPodTemplate", ray=False)
    return out


def check_ray_service(doc: dict) -> list[tuple]:
    """The RayService's cluster keeps every rule a RayCluster keeps; its Serve config is YAML
    naming at least one application by import path."""
    spec = doc.get("spec") or {}
    out = check_cluster_spec(spec.get("rayClusterConfig") or {}, "spec.rayClusterConfig", training=False)
    try:
        serve = yaml.safe_load(spec.get("serveConfigV2") or "")
    except yaml.YAMLError as err:
        return out + [("spec.serveConfigV2", f"not valid YAML ({getattr(err, 'problem', None) or err})")]
    apps = serve.get("applications") if isinstance(serve, dict) else None
    if not apps or not isinstance(apps, list):
        return out + [("spec.serveConfigV2", "names no applications (a Serve config file's `applications` list)")]
    for i, app in enumerate(apps):
        if not isinstance(app, dict) or not app.get("import_path"):
            out.append((f"spec.serveConfigV2.applications[{i}]", "no import_path"))
    return out


def allowed_outside_ports(peer: dict) -> set:
    """Ports a peer outside the run may reach: the head's client ports, and the Serve port for
    pods labelled as serve clients."""
    ports = set(HEAD_CLIENT_PORTS.values())
    if get(peer, "podSelector", "matchLabels", SERVE_CLIENT_LABEL) == "true" and "namespaceSelector" not in peer:
        ports.add(SERVE_PORT)
    return ports


def check_network_policy(doc: dict) -> list[tuple]:
    """Ingress only: each rule names its peers (no rule open to all), no ipBlock, and a peer
    outside the run reaches only the head's client ports (a serve client: the Serve port too)."""
    spec = doc.get("spec") or {}
    out = []
    if "Ingress" not in (spec.get("policyTypes") or []):
        out.append(("spec.policyTypes", "must include Ingress"))
    if not get(spec, "podSelector", "matchLabels", RUN_LABEL):
        out.append(("spec.podSelector.matchLabels", f"must select the run's pods by {RUN_LABEL}"))
    run = get(spec, "podSelector", "matchLabels", RUN_LABEL)
    for i, rule in enumerate(spec.get("ingress") or []):
        peers = rule.get("from") or []
        if not peers:
            out.append((f"spec.ingress[{i}].from", "an ingress rule without peers admits everyone"))
        for j, peer in enumerate(peers):
            if "ipBlock" in peer:
                out.append((f"spec.ingress[{i}].from[{j}].ipBlock", "ipBlock admits addresses, not the run's pods"))
            own = get(peer, "podSelector", "matchLabels", RUN_LABEL) == run and "namespaceSelector" not in peer
            ports = {p.get("port") for p in rule.get("ports") or []}
            allowed_ports = allowed_outside_ports(peer)
            if not own and (not ports or not ports <= allowed_ports):
                out.append((f"spec.ingress[{i}].ports", f"pods outside the run may reach only ports "
                                                        f"{sorted(allowed_ports)}"))
    return out


def check_policy(doc: dict) -> list[tuple]:
    out = [(format_path(path), "looks like a literal AWS access key id; use a service account or a secretKeyRef")
           for path, text in iter_strings(doc) if AWS_KEY_ID.search(text)]
    if doc.get("kind") == "RayCluster":
        out += check_cluster_spec(doc.get("spec") or {}, "spec")
    elif doc.get("kind") == "RayJob":
        out += check_ray_job(doc)
    elif doc.get("kind") == "RayService":
        out += check_ray_service(doc)
    elif doc.get("kind") == "NetworkPolicy":
        out += check_network_policy(doc)
    elif doc.get("kind") == "ServiceAccount" and get(doc, "metadata", "name") == "default":
        out.append(("metadata.name", "eft's pods never run as the 'default' service account"))
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


def check_run_is_fenced(docs: list[tuple[str, Any]], run: str) -> list[str]:
    """What a complete run (its ConfigMap is among the documents) lacks: a NetworkPolicy over its
    pods and a disruption budget for its head."""
    kinds = {(d.get("kind"), get(d, "spec", "podSelector" if d.get("kind") == "NetworkPolicy" else "selector",
                                  "matchLabels", RUN_LABEL))
             for _, d in docs if isinstance(d, dict)}
    return [kind for kind in ("NetworkPolicy", "PodDisruptionBudget") if (kind, run) not in kinds]


def check_documents(docs: list[tuple[str, Any]], schemas: dict) -> list[Violation]:
    """Schema + policy for each (manifest label, document), then each Ray manifest against the
    job config of the ConfigMap it mounts, when that ConfigMap is among the documents (and then
    the run must also carry its NetworkPolicy and head PodDisruptionBudget)."""
    out: list[Violation] = []
    configs: dict[str, JobConfig] = {}
    for manifest, doc in docs:
        out += check_schema(doc, schemas, manifest)
        if not isinstance(doc, dict):
            continue
        out += [Violation(manifest, *finding) for finding in check_policy(doc)]
        if doc.get("kind") == "ConfigMap":
            cfg, bad = parse_config_map_job(doc, manifest)
            out += bad
            if cfg is not None:
                configs[get(doc, "metadata", "name", default="")] = cfg
    for manifest, doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "RayService":
            # A service is a complete deployable on its own: its policy and budget come with it.
            run = get(doc, "metadata", "labels", RUN_LABEL, default="")
            out += [Violation(manifest, f"metadata.labels[{RUN_LABEL!r}]", f"service {run!r} has no {kind} "
                                                                            f"selecting its pods")
                    for kind in check_run_is_fenced(docs, run)]
        if not isinstance(doc, dict) or doc.get("kind") not in ("RayCluster", "RayJob"):
            continue
        at = "spec.rayClusterSpec" if doc["kind"] == "RayJob" else "spec"
        volumes = get(doc, *at.split("."), "headGroupSpec", "template", "spec", "volumes", default=[]) or []
        for volume in volumes:
            cfg = configs.get(get(volume, "configMap", "name", default=None))
            if cfg is not None:
                out += [Violation(manifest, f, m) for f, m in check_against_config(doc, cfg, at)]
                run = get(doc, "metadata", "labels", RUN_LABEL, default="")
                out += [Violation(manifest, f"metadata.labels[{RUN_LABEL!r}]", f"run {run!r} has no {kind} "
                                                                                f"selecting its pods")
                        for kind in check_run_is_fenced(docs, run)]
    return out


def errors_of(violations: list[Violation]) -> list[Violation]:
    return [v for v in violations if v.severity == ERROR]


class Unreadable(str):
    """Why a file under --check holds no manifest (it cannot be read, is not YAML, or a document
    in it is not a mapping): reported as a violation naming the file."""


def read_yaml_documents(path: Path) -> list[Any]:
    """The documents of one file; Unreadable entries for what is not a manifest."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return [Unreadable("not valid YAML (not UTF-8 text)")]
    except OSError as err:
        return [Unreadable(f"cannot read it ({err.strerror or type(err).__name__})")]
    try:
        found = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return [Unreadable(f"not valid YAML{where} ({getattr(err, 'problem', None) or err})")]
    if not found:
        return [Unreadable("no YAML document in it (empty)")]
    return [d if isinstance(d, dict) else
            Unreadable(f"not a Kubernetes manifest (a YAML {type(d).__name__}, not a mapping with apiVersion "
                       f"and kind)") for d in found]


def is_serve_config(doc: Any) -> bool:
    """A Ray Serve config file (`serve deploy FILE`): its `applications`, no Kubernetes kind."""
    return isinstance(doc, dict) and "applications" in doc and "kind" not in doc and "apiVersion" not in doc


def load_documents(target: str | Path) -> list[tuple[str, Any]]:
    """(label, document) for every YAML document under a file or directory; a file that holds no
    manifest gives (file, Unreadable(why)). Kustomization files and Serve config files (the
    `serve.yaml` beside a RayService) are not manifests and are skipped;
    a multi-document file labels each `file#Kind/name`."""
    target = Path(target)
    if not target.exists():
        raise ConfigError(f"--check: {target}: no such file or directory")
    files = [target] if target.is_file() else sorted(p for p in target.rglob("*") if p.suffix in (".yaml", ".yml"))
    docs = []
    for path in files:
        if path.name in ("kustomization.yaml", "kustomization.yml"):
            continue
        found = read_yaml_documents(path)
        if all(is_serve_config(doc) for doc in found):
            continue  # a Serve config file beside the RayService (serve.yaml): Ray's, not Kubernetes'
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
    out = [Violation(label, "<file>", str(doc)) for label, doc in docs if isinstance(doc, Unreadable)]
    out += check_documents([(label, doc) for label, doc in docs if not isinstance(doc, Unreadable)], schemas)
    return len(docs), out


def render_checked(cfg: JobConfig, overlay: Optional[str], image: Optional[str], node_type: Optional[str],
                   crd_dir: str | Path | None = None) -> tuple[dict[str, dict], list[Violation]]:
    """build_manifests, refusing to hand out anything the validator rejects; (manifests, warnings)."""
    manifests = build_manifests(cfg, overlay, image, node_type)
    problems = check_documents(list(manifests.items()), load_schemas(crd_dir))
    if errors := errors_of(problems):
        raise ValueError(f"rendered manifests fail validation: {errors[0]}")
    return manifests, problems


def render_service_checked(cfg: JobConfig, serve_app: dict, gpus_per_replica: int, overlay: Optional[str],
                           image: Optional[str], node_type: Optional[str] = None, crd_dir: str | Path | None = None,
                           annotations: Optional[dict] = None) -> tuple[dict[str, dict], list[Violation]]:
    """build_service_manifests, refusing to hand out anything the validator rejects; (manifests, warnings)."""
    manifests = build_service_manifests(cfg, serve_app, gpus_per_replica, overlay, image, node_type, annotations)
    problems = check_documents(list(manifests.items()), load_schemas(crd_dir))
    if errors := errors_of(problems):
        raise ValueError(f"rendered manifests fail validation: {errors[0]}")
    return manifests, problems
