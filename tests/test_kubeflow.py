"""Kubeflow manifests (the run under torchrun): a TrainJob on eft's own TrainingRuntime and an
elastic PyTorchJob, rendered from every job config on every overlay, built from the kubeflow/
kustomize trees with a real kubectl, validated strictly against the vendored Kubeflow Trainer
v2.3.0 and Training Operator v1.9.4 CRDs and the policy rules, with each rule shown to bite. The
rendered command is parsed by torchrun's own argument parser with the variables the operators
inject. No cluster needed."""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from test_kube import DELETE, IMAGE, REFERENCE, kubectl, mutate, run_cli, violations_of

from app import kube
from app.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "jobs" / "configs").glob("*.yaml"))
OVERLAYS = ["base", "eks-spot", "gke-spot", "kueue"]
FILES = {"trainjob": ["configmap.yaml", "networkpolicy.yaml", "serviceaccount.yaml", "trainingruntime.yaml",
                      "trainjob.yaml"],
         "pytorchjob": ["configmap.yaml", "networkpolicy.yaml", "pytorchjob.yaml", "serviceaccount.yaml"]}
RUNTIME_POD = "spec.template.spec.replicatedJobs.0.template.spec.template"
WORKER_POD = "spec.pytorchReplicaSpecs.Worker.template"
HARDENED = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True, "seccompProfile": {"type": "RuntimeDefault"}}


@pytest.fixture(scope="module")
def schemas():
    return kube.load_schemas()


@pytest.fixture(scope="module")
def rendered():
    cfg = load_config(REFERENCE)
    return {kind: kube.build_kubeflow_manifests(cfg, kind, "eks-spot", IMAGE) for kind in kube.KUBEFLOW_KINDS}


def field_path(dotted: str) -> str:
    """The policy's field notation for a mutation's dotted path (list indices in brackets)."""
    return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", dotted).replace("~", ".")


# ----------------------------------------------------------------------------- what must pass


def test_the_vendored_crds_are_the_releases_named_in_their_readme():
    readme = (ROOT / "app" / "kube" / "crds" / "README.md").read_text()
    for name in kube.CRD_FILES:
        digest = hashlib.sha256((ROOT / "app" / "kube" / "crds" / name).read_bytes()).hexdigest()
        assert f"| `{name}` |" in readme and digest in readme, name
    assert {("trainer.kubeflow.org/v1alpha1", k) for k in ("TrainJob", "TrainingRuntime", "ClusterTrainingRuntime")} \
        | {("kubeflow.org/v1", "PyTorchJob")} <= set(kube.load_schemas())


@pytest.mark.parametrize("kind", kube.KUBEFLOW_KINDS)
def test_every_config_renders_valid_manifests_on_every_overlay(kind, schemas):
    for config in CONFIGS:
        cfg = load_config(config)
        for overlay in OVERLAYS:
            docs = kube.build_kubeflow_manifests(cfg, kind, overlay, IMAGE)
            assert sorted(docs) == FILES[kind]
            assert violations_of(docs, schemas) == [], (config.name, overlay)


def test_the_pytorchjob_is_elastic_over_the_configs_nodes_and_hardened(rendered):
    """llama3-70b-lora: 16..32 workers at 1 GPU on 8-GPU p4d.24xlarge nodes, so 2..4 pods of 8
    ranks, c10d rendezvous, a failed rank restarting in its pod; every pod hardened as a Ray
    worker, on spot with its tolerations, over EFA, and given longer to stop than torchrun gives
    its ranks to checkpoint."""
    job = rendered["pytorchjob"]["pytorchjob.yaml"]
    spec = job["spec"]
    assert spec["elasticPolicy"] == {"minReplicas": 2, "maxReplicas": 4, "rdzvBackend": "c10d", "rdzvPort": 29400,
                                     "maxRestarts": 3}
    assert spec["nprocPerNode"] == "8" and list(spec["pytorchReplicaSpecs"]) == ["Worker"]
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert (worker["replicas"], worker["restartPolicy"]) == (4, "OnFailure")
    pod = worker["template"]["spec"]
    (main,) = pod["containers"]
    assert main["name"] == "pytorch" and main["image"] == IMAGE
    assert main["command"] == ["torchrun", "--shutdown-timeout=90", "-m", "app.train.torchrun", "/config/job.yaml",
                               "--wait-timeout-s", "300"]
    assert pod["terminationGracePeriodSeconds"] == 110 > 90
    assert {k: main["securityContext"][k] for k in HARDENED} == HARDENED
    assert main["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}  # EFA's, nothing more
    assert pod["serviceAccountName"] == "eft" and pod["automountServiceAccountToken"] is False
    assert kube.selects_spot(pod) == ["eks.amazonaws.com/capacityType", "karpenter.sh/capacity-type"]
    assert {t["key"] for t in pod["tolerations"]} >= {"karpenter.sh/capacity-type", "eks.amazonaws.com/capacityType"}
    assert main["resources"]["limits"]["vpc.amazonaws.com/efa"] == "4"
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["FI_PROVIDER"] == "efa" and "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S" not in env
    assert not any(re.search("SECRET|TOKEN|PASSWORD", name) for name in env)
    assert {"name": "job-config", "mountPath": "/config", "readOnly": True} in main["volumeMounts"]
    assert spec["runPolicy"]["backoffLimit"] >= 1 and "suspend" not in spec["runPolicy"]
    assert yaml.safe_load(rendered["pytorchjob"]["configmap.yaml"]["data"]["job.yaml"]) == \
        load_config(REFERENCE).model_dump(mode="json")
    policy = rendered["pytorchjob"]["networkpolicy.yaml"]["spec"]
    assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"eft/run": "llama3-70b-lora"}}}]}]


def test_the_trainjob_runs_on_its_own_runtime_at_the_configs_world_size(rendered):
    docs = rendered["trainjob"]
    job, runtime = docs["trainjob.yaml"], docs["trainingruntime.yaml"]
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                                         "name": runtime["metadata"]["name"]}
    # Trainer v2 has no elastic torch policy: scaling.max_workers, in whole nodes, throughout.
    assert job["spec"]["trainer"] == {"numNodes": 4, "numProcPerNode": 8}
    spec = runtime["spec"]
    assert spec["mlPolicy"] == {"numNodes": 4, "torch": {}}
    assert spec["template"]["spec"]["failurePolicy"] == {"maxRestarts": 3}
    (step,) = spec["template"]["spec"]["replicatedJobs"]
    assert step["name"] == "node"
    assert step["template"]["metadata"]["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    assert step["template"]["spec"]["backoffLimit"] == 0  # one failed rank restarts the whole JobSet
    pod = step["template"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["name"] == "node" and pod["restartPolicy"] == "Never"
    assert pod["containers"][0]["command"] == rendered["pytorchjob"]["pytorchjob.yaml"]["spec"][
        "pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]


@pytest.mark.parametrize("kind", kube.KUBEFLOW_KINDS)
def test_kueue_holds_the_job_until_admission(kind, schemas):
    docs = kube.build_kubeflow_manifests(load_config(REFERENCE), kind, "kueue", IMAGE)
    job = docs[f"{kind}.yaml"]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "eft"
    suspended = job["spec"]["suspend"] if kind == "trainjob" else job["spec"]["runPolicy"]["suspend"]
    assert suspended is True


@pytest.mark.parametrize("kind", kube.KUBEFLOW_KINDS)
def test_torchruns_own_parser_reads_the_command_with_the_operators_variables(kind, rendered, monkeypatch):
    """What the pod runs, parsed by torch.distributed.run's parser with the PET_* variables each
    operator injects (PyTorchJob elastic: nnodes MIN:MAX and a c10d endpoint; TrainJob: a fixed
    node count, node rank and master), then the entry's own parser on what torchrun hands it."""
    from torch.distributed.run import get_args_parser

    from app.train.torchrun import build_parser

    docs = rendered[kind]
    if kind == "pytorchjob":
        pod = docs["pytorchjob.yaml"]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        injected = {"PET_NNODES": "2:4", "PET_NPROC_PER_NODE": "8", "PET_RDZV_BACKEND": "c10d",
                    "PET_RDZV_ENDPOINT": "llama3-70b-lora-worker-0:29400", "PET_MAX_RESTARTS": "3"}
    else:
        pod = docs["trainingruntime.yaml"]["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
            "template"]
        injected = {"PET_NNODES": "4", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "1",
                    "PET_MASTER_ADDR": "llama3-70b-lora-node-0-0.llama3-70b-lora", "PET_MASTER_PORT": "29400"}
    for name, value in injected.items():
        monkeypatch.setenv(name, value)
    command = pod["spec"]["containers"][0]["command"]
    assert command[0] == "torchrun"
    args = get_args_parser().parse_args(command[1:])
    assert (args.nnodes, args.nproc_per_node) == (injected["PET_NNODES"], "8")
    assert args.shutdown_timeout == 90 and args.module and args.training_script == "app.train.torchrun"
    assert "SIGTERM" in args.signals_to_handle.split(",")
    entry = build_parser().parse_args(args.training_script_args)
    assert (entry.config, entry.wait_timeout_s, entry.set) == ("/config/job.yaml", 300.0, [])


def test_the_kustomize_trees_are_what_the_renderer_gives():
    trees = kube.build_kustomize_trees()
    assert {rel.split("/")[0] for rel in trees} == {"kuberay", "kubeflow"}
    for rel, text in trees.items():
        assert (ROOT / rel).read_text() == text, (
            f"{rel} is stale: python -c 'from app.kube import write_kustomize_tree; write_kustomize_tree()'")


@pytest.mark.parametrize("kind", kube.KUBEFLOW_KINDS)
def test_the_overlays_build_with_kubectl_and_pass(kind, schemas):
    for overlay in ["base", *(f"overlays/{o}" for o in kube.KUSTOMIZE_OVERLAYS)]:
        built = subprocess.run([kubectl(), "kustomize", str(ROOT / "kubeflow" / kind / overlay)],
                               capture_output=True, text=True, timeout=60)
        assert built.returncode == 0, built.stderr
        docs = [d for d in yaml.safe_load_all(built.stdout) if d]
        assert sorted(f"{d['kind'].lower()}.yaml" for d in docs) == FILES[kind]
        found = kube.errors_of(kube.check_documents([(f"{overlay}#{d['kind']}", d) for d in docs], schemas))
        assert found == [], [str(v) for v in found]


# ----------------------------------------------------------------------------- each rule bites


POD_MUTATIONS = {
    "runs as root": ("spec.containers.0.securityContext.runAsUser", 0, "spec.containers[0].securityContext.runAsUser",
                     "0 runs as root"),
    "privilege escalation": ("spec.containers.0.securityContext.allowPrivilegeEscalation", True,
                             "spec.containers[0].securityContext.allowPrivilegeEscalation", "must be false"),
    "capabilities kept": ("spec.containers.0.securityContext.capabilities", {"drop": ["NET_RAW"]},
                          "spec.containers[0].securityContext.capabilities.drop", 'must drop ["ALL"]'),
    "extra capability": ("spec.containers.0.securityContext.capabilities.add", ["IPC_LOCK", "SYS_ADMIN"],
                         "spec.containers[0].securityContext.capabilities.add", "must add no capabilities"),
    "seccomp unconfined": ("spec.containers.0.securityContext.seccompProfile.type", "Unconfined",
                           "spec.containers[0].securityContext.seccompProfile.type", "must be RuntimeDefault"),
    "default service account": ("spec.serviceAccountName", "default", "spec.serviceAccountName", "never 'default'"),
    "API token automounted": ("spec.automountServiceAccountToken", True, "spec.automountServiceAccountToken",
                              "must be false"),
    "host network": ("spec.hostNetwork", True, "spec", "must not share the host's network"),
    "literal AWS secret": ("spec.containers.0.env.0", {"name": "AWS_SECRET_ACCESS_KEY", "value": "wJalrXUtnFEMI"},
                           "spec.containers[0].env[0].value", "literal credential"),
    "untagged image": ("spec.containers.0.image", "registry.example.com/eft", "spec.containers[0].image",
                       "not pinned by tag"),
    "no /dev/shm": ("spec.volumes.0.emptyDir", {}, "spec.volumes", "/dev/shm must be a memory emptyDir"),
    "no ephemeral storage": ("spec.containers.0.resources.requests.ephemeral-storage", DELETE,
                             "spec.containers[0].resources.requests", "ephemeral-storage must be requested"),
    "default shutdown timeout": ("spec.containers.0.command.1", "--max-restarts=3", "spec.containers[0].command",
                                 "--shutdown-timeout=S must be set"),
    "grace shorter than the save": ("spec.terminationGracePeriodSeconds", 60, "spec.terminationGracePeriodSeconds",
                                    "60 must be longer than torchrun's --shutdown-timeout (90)"),
    "not eft's loop": ("spec.containers.0.command", ["torchrun", "--shutdown-timeout=90", "train.py"],
                       "spec.containers[0].command", "must run 'torchrun -m app.train.torchrun /config/job.yaml'"),
    "config not mounted": ("spec.containers.0.volumeMounts.3.mountPath", "/etc/eft", "spec.containers[0].volumeMounts",
                           "the job config must be mounted at /config"),
    "spot without toleration": ("spec.tolerations", [], "spec.tolerations", "does not tolerate the spot taint"),
    "no EFA across nodes": ("spec.containers.0.resources.limits.vpc~amazonaws~com/efa", DELETE, "spec",
                            "without their efa fabric"),
    "misspelled pod field": ("spec.terminationGracePeriod", 30, "spec.terminationGracePeriod", "unknown field"),
}


@pytest.mark.parametrize("case", POD_MUTATIONS, ids=list(POD_MUTATIONS))
@pytest.mark.parametrize("kind", kube.KUBEFLOW_KINDS)
def test_pod_checks_bite(case, kind, rendered, schemas):
    dotted, value, field, message = POD_MUTATIONS[case]
    file_name, at = ("pytorchjob.yaml", WORKER_POD) if kind == "pytorchjob" else ("trainingruntime.yaml", RUNTIME_POD)
    docs = rendered[kind]
    broken = mutate(docs[file_name], f"{at}.{dotted}", value)
    if case == "no EFA across nodes":
        broken = mutate(broken, f"{at}.spec.containers.0.resources.requests.vpc~amazonaws~com/efa", DELETE)
    found = violations_of(dict(docs, **{file_name: broken}), schemas)
    want = f"{file_name}: {field_path(at)}.{field}: "
    assert any(line.startswith(want) and message in line for line in found), (want, found)


JOB_MUTATIONS = {
    "pytorchjob": {
        "not elastic": ("spec.elasticPolicy", DELETE, "spec.elasticPolicy", "must be set"),
        "etcd rendezvous": ("spec.elasticPolicy.rdzvBackend", "etcd", "spec.elasticPolicy.rdzvBackend",
                            "must be 'c10d'"),
        "min over max": ("spec.elasticPolicy.minReplicas", 5, "spec.elasticPolicy.minReplicas",
                         "need 1 <= minReplicas <= maxReplicas"),
        "a master": ("spec.pytorchReplicaSpecs.Master", {"replicas": 1, "restartPolicy": "OnFailure",
                                                         "template": {"spec": {"containers": []}}},
                     "spec.pytorchReplicaSpecs.Master", "Worker replicas only"),
        "never restarts": ("spec.pytorchReplicaSpecs.Worker.restartPolicy", "Never",
                           "spec.pytorchReplicaSpecs.Worker.restartPolicy", "must be OnFailure"),
        "no retries": ("spec.runPolicy.backoffLimit", 0, "spec.runPolicy.backoffLimit", ">= 1"),
        "no deadline": ("spec.runPolicy.activeDeadlineSeconds", DELETE, "spec.runPolicy.activeDeadlineSeconds",
                        ">= 1"),
        "kueue not suspended": ("metadata.labels.kueue~x-k8s~io/queue-name", "eft", "spec.runPolicy.suspend",
                                "must be true under Kueue"),
        "nodes off the config": ("spec.elasticPolicy.maxReplicas", 3, "spec.elasticPolicy.maxReplicas",
                                 "maxReplicas x nprocPerNode: 3 x 8 processes = 24 does not match "
                                 "scaling.max_workers (32)"),
        "ranks off the config": ("spec.nprocPerNode", "4", "spec.elasticPolicy.minReplicas",
                                 "2 x 4 processes = 8 does not match scaling.min_workers (16)"),
        "operator cannot find its container": ("spec.pytorchReplicaSpecs.Worker.template.spec.containers.0.name",
                                               "trainer", "spec.pytorchReplicaSpecs.Worker.template.spec."
                                               "containers[0].name", "must be 'pytorch'"),
        "misspelled": ("spec.elasticPolicy.maxReplica", 4, "spec.elasticPolicy.maxReplica", "unknown field"),
    },
    "trainjob": {
        "kueue not suspended": ("metadata.labels.kueue~x-k8s~io/queue-name", "eft", "spec.suspend",
                                "must be true under Kueue"),
        "moving image": ("spec.trainer.image", "registry.example.com/eft:latest", "spec.trainer.image", "'latest'"),
        "not eft's loop": ("spec.trainer.command", ["python", "train.py"], "spec.trainer.command",
                           "must run torchrun -m app.train.torchrun"),
        "literal secret": ("spec.trainer.env", [{"name": "HF_TOKEN", "value": "hf_abc"}], "spec.trainer.env[0].value",
                           "literal credential"),
        "no deadline": ("spec.activeDeadlineSeconds", DELETE, "spec.activeDeadlineSeconds", ">= 1"),
        "nodes off the config": ("spec.trainer.numNodes", 3, "spec.trainer.numNodes",
                                 "3 x 8 processes = 24 does not match scaling.max_workers (32)"),
        "misspelled": ("spec.trainer.numNode", 4, "spec.trainer.numNode", "unknown field"),
    },
}
RUNTIME_MUTATIONS = {
    "no torch policy": ("spec.mlPolicy.torch", DELETE, "spec.mlPolicy.torch", "must be set"),
    "no trainer step": ("spec.template.spec.replicatedJobs.0.name", "launcher", "spec.template.spec.replicatedJobs",
                        "needs the replicated job 'node'"),
    "not the trainer step": ("spec.template.spec.replicatedJobs.0.template.metadata.labels", {},
                             "spec.template.spec.replicatedJobs[0].template.metadata.labels",
                             'trainjob-ancestor-step must be "trainer"'),
    "Trainer cannot find its container": (f"{RUNTIME_POD}.spec.containers.0.name", "trainer",
                                          f"{field_path(RUNTIME_POD)}.spec.containers[0].name", "must be 'node'"),
    # The CRD's CEL rule (the API server's, which a schema check does not run), kept by the policy.
    "two policies": ("spec.mlPolicy.mpi", {}, "spec.mlPolicy", "only one of torch, mpi"),
}


@pytest.mark.parametrize("kind, case", [(k, c) for k, cases in JOB_MUTATIONS.items() for c in cases] +
                         [("trainingruntime", c) for c in RUNTIME_MUTATIONS])
def test_job_checks_bite(kind, case, rendered, schemas):
    cases = RUNTIME_MUTATIONS if kind == "trainingruntime" else JOB_MUTATIONS[kind]
    dotted, value, field, message = cases[case]
    docs = rendered["trainjob" if kind == "trainingruntime" else kind]
    file_name = f"{kind}.yaml"
    found = violations_of(dict(docs, **{file_name: mutate(docs[file_name], dotted, value)}), schemas)
    assert any(line.startswith(f"{file_name}: {field}: ") and message in line for line in found), found


@pytest.mark.parametrize("kind", kube.KUBEFLOW_KINDS)
def test_a_complete_run_needs_its_network_policy(kind, rendered, schemas):
    docs = {k: v for k, v in rendered[kind].items() if k != "networkpolicy.yaml"}
    found = violations_of(docs, schemas)
    assert f"{kind}.yaml: metadata.labels['eft/run']: run 'llama3-70b-lora' has no NetworkPolicy selecting its " \
           "pods" in found, found


def test_a_trainjob_on_a_runtime_not_given_is_a_warning_naming_it(rendered, schemas):
    docs = {k: v for k, v in rendered["trainjob"].items() if k != "trainingruntime.yaml"}
    problems = kube.check_documents(list(docs.items()), schemas)
    assert kube.errors_of(problems) == []
    assert [str(p) for p in problems] == [
        "trainjob.yaml: spec.runtimeRef: warning: TrainingRuntime 'llama3-70b-lora-torchrun' is not among the checked "
        "manifests: its pods are not checked"]


# ----------------------------------------------------------------------------- the command line


def test_cli_renders_checks_and_refuses_in_one_line(tmp_path):
    out = tmp_path / "kf"
    made = run_cli(str(REFERENCE), "--kubeflow", "trainjob", "--overlay", "eks-spot", "--image", IMAGE,
                   "--out", str(out))
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in out.iterdir()) == FILES["trainjob"]
    assert made.stderr.splitlines()[-1] == ("eft: workers: up to 4 p4d.24xlarge node(s) over AWS Elastic Fabric "
                                            "Adapter through aws-ofi-nccl (libfabric efa provider)")
    assert "eft: warning: a TrainJob is not elastic: it runs scaling.max_workers (32) throughout" in made.stderr
    checked = run_cli("--check", str(out))
    assert checked.returncode == 0 and checked.stdout.startswith("ok: 5 manifest(s) pass"), checked
    runtime = yaml.safe_load((out / "trainingruntime.yaml").read_text())
    runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] = 30
    (out / "trainingruntime.yaml").write_text(yaml.safe_dump(runtime))
    broken = run_cli("--check", str(out))
    assert broken.returncode == 1
    assert broken.stdout.splitlines() == [
        f"{out}/trainingruntime.yaml: spec.template.spec.replicatedJobs[0].template.spec.template.spec."
        "terminationGracePeriodSeconds: 30 must be longer than torchrun's --shutdown-timeout (90) so the ranks "
        "checkpoint before the kill"]
    for args, line in [
        (["--kubeflow", "mpijob"], "eft: error: --kubeflow: unknown kind 'mpijob' (choose one of trainjob, pytorchjob)"),
        (["--kubeflow", "trainjob", "--serve"],
         "eft: error: --kubeflow: not with --serve (serving runs on Ray Serve: a RayService)"),
    ]:
        bad = run_cli(str(REFERENCE), *args, "--overlay", "eks-spot", "--image", IMAGE, "--out", str(tmp_path / "x"))
        assert (bad.returncode, bad.stderr.strip()) == (2, line)
        assert not (tmp_path / "x").exists()
