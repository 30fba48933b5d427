"""The rules every manifest must keep beyond its schema (token auth, non-root hardened
containers, a dedicated service account, head off spot, drain timing, pinned images, no
literal credentials...), each Ray or Kubeflow manifest checked against the job config it mounts,
and `render_checked` / `render_kubeflow_checked`, which refuse to hand out anything the checks
reject.

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
from app.kube.kubeflow import (ANCESTOR_LABEL, PYTORCHJOB_CONTAINER, SHUTDOWN_FLAG, TORCHRUN_MODULE,
                               TRAINJOB_CONTAINER, TRAINJOB_STEP, build_kubeflow_manifests)
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
    if "rayjob.yaml" in manifests:
        group = get(manifests["rayjob.yaml"], "spec", "rayClusterSpec", "workerGroupSpecs", 0, default={}) or {}
    elif "pytorchjob.yaml" in manifests:
        spec = manifests["pytorchjob.yaml"]["spec"]
        group = {"template": spec["pytorchReplicaSpecs"]["Worker"]["template"],
                 "maxReplicas": spec["elasticPolicy"]["maxReplicas"]}
    else:
        runtime = manifests["trainingruntime.yaml"]["spec"]
        group = {"template": runtime["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"],
                 "maxReplicas": runtime["mlPolicy"]["numNodes"]}
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


def check_pod(pod: dict, at: str, *, ray: bool, drain: bool = True) -> list[tuple]:
    """`ray`: a training pod (Ray's, or torchrun's with `drain` False: its stop budget is
    torchrun's shutdown timeout, checked with its command)."""
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
    if not drain:
        return out
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


def check_torch_pod(pod: dict, at: str, nodes: int) -> list[tuple]:
    """A torchrun pod of a Kubeflow job: hardened as a Ray worker (fabric for `nodes` nodes, spot
    tolerations), running eft's torchrun entry on the mounted job config, with a grace period
    longer than torchrun's shutdown timeout (the ranks' just-in-time checkpoint after SIGTERM)."""
    out = check_pod(pod, at, ray=True, drain=False)
    spec = pod.get("spec") or {}
    out += check_worker_fabric({"template": pod, "maxReplicas": nodes}, at.removesuffix(".template"))
    for key in selects_spot(spec):
        if not tolerates(spec, key):
            out.append((f"{at}.spec.tolerations", f"selects spot nodes ({key}) but does not tolerate the spot taint"))
    main = get(spec, "containers", 0, default={}) or {}
    command = [str(x) for x in (main.get("command") or []) + (main.get("args") or [])]
    want = ["torchrun", "-m", TORCHRUN_MODULE, f"{CONFIG_MOUNT}/job.yaml"]
    if not command or command[0] != "torchrun" or not is_subsequence(want[1:], command):
        out.append((f"{at}.spec.containers[0].command", f"must run {' '.join(want)!r} (eft's loop under torchrun "
                                                        f"on the mounted job config)"))
    mounts = {m.get("mountPath") for m in main.get("volumeMounts") or []}
    if CONFIG_MOUNT not in mounts:
        out.append((f"{at}.spec.containers[0].volumeMounts", f"the job config must be mounted at {CONFIG_MOUNT}"))
    timeout = next((arg.split("=", 1)[1] for arg in command if arg.startswith(f"{SHUTDOWN_FLAG}=")), None)
    grace = spec.get("terminationGracePeriodSeconds")
    if timeout is None or not timeout.isdigit():
        out.append((f"{at}.spec.containers[0].command", f"{SHUTDOWN_FLAG}=S must be set (torchrun's default 30 s "
                                                        f"may cut the just-in-time checkpoint short)"))
    elif not isinstance(grace, int) or grace <= int(timeout):
        out.append((f"{at}.spec.terminationGracePeriodSeconds",
                    f"{grace} must be longer than torchrun's {SHUTDOWN_FLAG} ({timeout}) so the ranks checkpoint "
                    f"before the kill"))
    return out


def is_subsequence(want: list[str], have: list[str]) -> bool:
    """`want` appears in `have` as consecutive items."""
    return any(have[i:i + len(want)] == want for i in range(len(have) - len(want) + 1))


def check_kueue_suspended(doc: dict, suspend_at: tuple[str, ...]) -> list[tuple]:
    if KUEUE_QUEUE_LABEL in (get(doc, "metadata", "labels", default={}) or {}) and \
            get(doc, *suspend_at) is not True:
        return [(".".join(suspend_at), "must be true under Kueue (it unsuspends the job on admission)")]
    return []


ML_POLICIES = ("torch", "mpi", "jax", "xgboost", "flux")


def check_training_runtime(doc: dict) -> list[tuple]:
    """eft's TrainingRuntime (or a ClusterTrainingRuntime it runs on): the torch policy and one
    `node` step whose pods keep the torchrun pod's rules."""
    spec = doc.get("spec") or {}
    out = []
    policies = [k for k in ML_POLICIES if k in (get(spec, "mlPolicy", default={}) or {})]
    if "torch" not in policies:
        out.append(("spec.mlPolicy.torch", "must be set (the torch plugin injects torchrun's PET_* variables)"))
    if len(policies) > 1:
        # The CRD's own CEL rule, which the API server runs and a schema check does not.
        out.append(("spec.mlPolicy", f"only one of {', '.join(ML_POLICIES)} may be set (sets {policies})"))
    nodes = get(spec, "mlPolicy", "numNodes", default=1)
    jobs = get(spec, "template", "spec", "replicatedJobs", default=[]) or []
    if not any(j.get("name") == TRAINJOB_STEP for j in jobs):
        out.append(("spec.template.spec.replicatedJobs", f"needs the replicated job {TRAINJOB_STEP!r} "
                                                         f"(the trainer step the torch plugin configures)"))
    for i, job in enumerate(jobs):
        at = f"spec.template.spec.replicatedJobs[{i}].template.spec.template"
        pod = get(job, "template", "spec", "template", default={}) or {}
        if job.get("name") == TRAINJOB_STEP:
            if get(job, "template", "metadata", "labels", ANCESTOR_LABEL) != "trainer":
                out.append((f"spec.template.spec.replicatedJobs[{i}].template.metadata.labels",
                            f'{ANCESTOR_LABEL} must be "trainer"'))
            if get(pod, "spec", "containers", 0, "name") != TRAINJOB_CONTAINER:
                out.append((f"{at}.spec.containers[0].name", f"must be {TRAINJOB_CONTAINER!r} (the container "
                                                             f"Trainer injects PET_* into)"))
            out += check_torch_pod(pod, at, nodes if isinstance(nodes, int) else 1)
        else:
            out += check_pod(pod, at, ray=False)
    return out


def check_train_job(doc: dict) -> list[tuple]:
    spec = doc.get("spec") or {}
    trainer = spec.get("trainer") or {}
    out = check_kueue_suspended(doc, ("spec", "suspend"))
    if not isinstance(spec.get("activeDeadlineSeconds"), int) or spec["activeDeadlineSeconds"] < 1:
        out.append(("spec.activeDeadlineSeconds", "must be set to an integer >= 1"))
    if "image" in trainer and (problem := check_image(trainer["image"])):
        out.append(("spec.trainer.image", problem))
    command = [str(x) for x in (trainer.get("command") or []) + (trainer.get("args") or [])]
    if command and (command[0] != "torchrun" or TORCHRUN_MODULE not in command):
        out.append(("spec.trainer.command", f"must run torchrun -m {TORCHRUN_MODULE} (or be left to the runtime)"))
    for i, env in enumerate(trainer.get("env") or []):
        if SECRET_NAME.search(env.get("name", "")) and "value" in env:
            out.append((f"spec.trainer.env[{i}].value", f"{env['name']} is a literal credential; use a "
                                                        f"secretKeyRef or a service account"))
    return out


def check_pytorch_job(doc: dict) -> list[tuple]:
    """An elastic PyTorchJob: workers only (c10d rendezvous, no master), bounded retries, and pods
    that keep the torchrun pod's rules."""
    spec = doc.get("spec") or {}
    out = check_kueue_suspended(doc, ("spec", "runPolicy", "suspend"))
    elastic = spec.get("elasticPolicy")
    if not elastic:
        out.append(("spec.elasticPolicy", "must be set (min/max replicas: the job re-forms at a new size "
                                          "instead of failing when a node goes)"))
    else:
        if elastic.get("rdzvBackend") != "c10d":
            out.append(("spec.elasticPolicy.rdzvBackend", f"{elastic.get('rdzvBackend')!r} must be 'c10d'"))
        lo, hi = elastic.get("minReplicas"), elastic.get("maxReplicas")
        if not isinstance(lo, int) or not isinstance(hi, int) or lo > hi or lo < 1:
            out.append(("spec.elasticPolicy.minReplicas", f"{lo}..{hi}: need 1 <= minReplicas <= maxReplicas"))
    for key in ("backoffLimit", "activeDeadlineSeconds"):
        if not isinstance(get(spec, "runPolicy", key), int) or get(spec, "runPolicy", key) < 1:
            out.append((f"spec.runPolicy.{key}", "must be set to an integer >= 1"))
    replicas = spec.get("pytorchReplicaSpecs") or {}
    for role in replicas:
        if role != "Worker":
            out.append((f"spec.pytorchReplicaSpecs.{role}", "an elastic job has Worker replicas only (the "
                                                            "rendezvous replaces the master)"))
    for role, replica in replicas.items():
        at = f"spec.pytorchReplicaSpecs.{role}.template"
        if replica.get("restartPolicy") not in ("OnFailure", "ExitCode"):
            out.append((f"spec.pytorchReplicaSpecs.{role}.restartPolicy",
                        f"{replica.get('restartPolicy')!r} must be OnFailure (or ExitCode): a failed rank restarts "
                        f"and rejoins"))
        tpl = replica.get("template") or {}
        if get(tpl, "spec", "containers", 0, "name") != PYTORCHJOB_CONTAINER:
            out.append((f"{at}.spec.containers[0].name", f"must be {PYTORCHJOB_CONTAINER!r} (the container the "
                                                         f"operator injects the rendezvous into)"))
        nodes = get(elastic, "maxReplicas", default=replica.get("replicas", 1)) if elastic else replica.get("replicas")
        out += check_torch_pod(tpl, at, nodes if isinstance(nodes, int) else 1)
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
    elif doc.get("kind") in ("TrainingRuntime", "ClusterTrainingRuntime"):
        out += check_training_runtime(doc)
    elif doc.get("kind") == "TrainJob":
        out += check_train_job(doc)
    elif doc.get("kind") == "PyTorchJob":
        out += check_pytorch_job(doc)
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


def mounted_config(pod: dict, configs: dict[str, JobConfig]) -> Optional[JobConfig]:
    for volume in get(pod, "spec", "volumes", default=[]) or []:
        if (cfg := configs.get(get(volume, "configMap", "name", default=None))) is not None:
            return cfg
    return None


def check_world_size(field: str, what: str, nodes: Any, per_node: Any, workers: int, key: str) -> list[tuple]:
    try:
        have = int(nodes) * int(per_node)
    except (TypeError, ValueError):
        return [(field, f"{nodes} nodes x {per_node} processes is not a world size")]
    if have != workers:
        return [(field, f"{what} {nodes} x {per_node} processes = {have} does not match scaling.{key} ({workers})")]
    return []


def check_kubeflow_run(manifest: str, doc: dict, docs: list[tuple[str, Any]],
                       configs: dict[str, JobConfig]) -> list[Violation]:
    """A TrainJob (through its TrainingRuntime) or PyTorchJob against the job config its pods
    mount, when that ConfigMap is among the documents: the world size is the config's, and the run
    carries its NetworkPolicy."""
    out = []
    spec = doc.get("spec") or {}
    if doc["kind"] == "TrainJob":
        ref = spec.get("runtimeRef") or {}
        runtime = next((d for _, d in docs if isinstance(d, dict) and d.get("kind") == ref.get("kind", "ClusterTrainingRuntime")
                        and get(d, "metadata", "name") == ref.get("name")), None)
        if runtime is None:
            return [Violation(manifest, "spec.runtimeRef", f"{ref.get('kind', 'ClusterTrainingRuntime')} "
                                                           f"{ref.get('name')!r} is not among the checked manifests: "
                                                           f"its pods are not checked", WARNING)]
        pod = get(runtime, "spec", "template", "spec", "replicatedJobs", 0, "template", "spec", "template", default={})
        cfg = mounted_config(pod, configs)
        if cfg is None:
            return []
        nodes = get(spec, "trainer", "numNodes", default=get(runtime, "spec", "mlPolicy", "numNodes", default=1))
        per_node = get(spec, "trainer", "numProcPerNode", default=None)
        found = check_world_size("spec.trainer.numNodes", "numNodes x numProcPerNode:", nodes, per_node,
                                 cfg.scaling.max_workers, "max_workers")
        if cfg.scaling.min_workers < cfg.scaling.max_workers:
            found.append(("spec.trainer.numNodes", f"a TrainJob is not elastic: it runs scaling.max_workers "
                                                   f"({cfg.scaling.max_workers}) throughout, never fewer "
                                                   f"(--kubeflow pytorchjob re-forms between min_workers and "
                                                   f"max_workers)", WARNING))
    else:
        pod = get(spec, "pytorchReplicaSpecs", "Worker", "template", default={}) or {}
        cfg = mounted_config(pod, configs)
        if cfg is None:
            return []
        found = []
        for key, field in (("minReplicas", "min_workers"), ("maxReplicas", "max_workers")):
            found += check_world_size(f"spec.elasticPolicy.{key}", f"{key} x nprocPerNode:",
                                      get(spec, "elasticPolicy", key), spec.get("nprocPerNode"),
                                      getattr(cfg.scaling, field), field)
    out += [Violation(manifest, *finding) for finding in found]
    run = get(doc, "metadata", "labels", RUN_LABEL, default="")
    if "NetworkPolicy" in check_run_is_fenced(docs, run):
        out.append(Violation(manifest, f"metadata.labels[{RUN_LABEL!r}]", f"run {run!r} has no NetworkPolicy "
                                                                          f"selecting its pods"))
    return out


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
        if isinstance(doc, dict) and doc.get("kind") in ("TrainJob", "PyTorchJob"):
            out += check_kubeflow_run(manifest, doc, docs, configs)
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


def refuse_unchecked(manifests: dict[str, dict], crd_dir: str | Path | None) -> tuple[dict[str, dict], list[Violation]]:
    """(manifests, warnings), or ValueError naming the first error: nothing the validator rejects is handed out."""
    problems = check_documents(list(manifests.items()), load_schemas(crd_dir))
    if errors := errors_of(problems):
        raise ValueError(f"rendered manifests fail validation: {errors[0]}")
    return manifests, problems


def render_checked(cfg: JobConfig, overlay: Optional[str], image: Optional[str], node_type: Optional[str],
                   crd_dir: str | Path | None = None) -> tuple[dict[str, dict], list[Violation]]:
    """build_manifests, refusing to hand out anything the validator rejects; (manifests, warnings)."""
    return refuse_unchecked(build_manifests(cfg, overlay, image, node_type), crd_dir)


def render_kubeflow_checked(cfg: JobConfig, kind: str, overlay: Optional[str], image: Optional[str],
                            node_type: Optional[str], crd_dir: str | Path | None = None
                            ) -> tuple[dict[str, dict], list[Violation]]:
    """build_kubeflow_manifests, refusing to hand out anything the validator rejects; (manifests, warnings)."""
    return refuse_unchecked(build_kubeflow_manifests(cfg, kind, overlay, image, node_type), crd_dir)


def render_service_checked(cfg: JobConfig, serve_app: dict, gpus_per_replica: int, overlay: Optional[str],
                           image: Optional[str], node_type: Optional[str] = None, crd_dir: str | Path | None = None,
                           annotations: Optional[dict] = None) -> tuple[dict[str, dict], list[Violation]]:
    """build_service_manifests, refusing to hand out anything the validator rejects; (manifests, warnings)."""
    return refuse_unchecked(build_service_manifests(cfg, serve_app, gpus_per_replica, overlay, image, node_type,
                                                    annotations), crd_dir)
