"""Kubeflow manifests derived from a job config: the same run under torchrun, for clusters that run
Kubeflow rather than KubeRay.

`build_kubeflow_manifests(cfg, "trainjob" | "pytorchjob", ...)` gives the ConfigMap (the resolved
job.yaml), the run's ServiceAccount and a NetworkPolicy, plus either
- a **TrainJob** (Kubeflow Trainer v2, `trainer.kubeflow.org/v1alpha1`) on a TrainingRuntime of
  the run's own, whose one replicated job `node` holds the hardened pod. Trainer's torch plugin
  injects the PET_* variables torchrun reads (nodes, ranks, master address), so the command names
  none of them. Trainer v2 has no elastic torch policy: the world size is fixed at
  `scaling.max_workers`, and a lost pod restarts the whole JobSet, which resumes from the latest
  checkpoint;
- or a **PyTorchJob** (Training Operator v1, `kubeflow.org/v1`) with an `elasticPolicy`: between
  `scaling.min_workers` and `max_workers` (in whole nodes), c10d rendezvous on the first pod, and a
  pod that fails restarts in place and rejoins (torchrun re-forms the group at the new size,
  resuming from the latest checkpoint).

Every pod is the Ray worker's (app/kube/render.py): the non-root read-only container with no
capabilities, the `eft` ServiceAccount without an API token, no credentials, spot-only with its
tolerations on spot overlays, the fabric (EFA / GPUDirect) for multi-node GPU groups, and a
termination grace period longer than torchrun's `--shutdown-timeout`, the time the ranks get to
take their just-in-time checkpoint after SIGTERM (app/elastic/signals.py).
"""

from __future__ import annotations

import math
from typing import Optional

from app.config import ConfigError, JobConfig
from app.kube.render import (CONFIG_MOUNT, KUEUE_QUEUE_LABEL, ONE_DAY_S, RUN_LABEL, Overlay, Placement,
                             build_config_map, build_kube_name, build_labels, build_service_account, build_worker_template,
                             check_image, lease_wait_s, plan_placement, resolve_node_type, resolve_overlay)

KUBEFLOW_KINDS = ("trainjob", "pytorchjob")
TRAINER_GROUP = "trainer.kubeflow.org"
TRAINER_API = f"{TRAINER_GROUP}/v1alpha1"
PYTORCHJOB_API = "kubeflow.org/v1"
TORCHRUN_MODULE = "app.train.torchrun"
SHUTDOWN_FLAG = "--shutdown-timeout"
# The names the operators look for: Trainer's torch plugin injects PET_* into the container `node`
# of the replicated job `node` labelled as the trainer step; the Training Operator's into `pytorch`.
TRAINJOB_STEP = "node"
TRAINJOB_CONTAINER = "node"
ANCESTOR_LABEL = f"{TRAINER_GROUP}/trainjob-ancestor-step"
PYTORCHJOB_CONTAINER = "pytorch"
RDZV_PORT = 29400  # the Training Operator's default c10d port on the first worker's Service
RESTARTS = 3


def build_torchrun_command(cfg: JobConfig, overlay: Overlay) -> list[str]:
    """torchrun takes its nodes, ranks and rendezvous from the operator's PET_* variables. After
    SIGTERM it forwards the signal and gives the ranks the overlay's drain time to checkpoint; rank 0
    of a restarted group waits for the run lease the killed one may still hold."""
    return ["torchrun", f"{SHUTDOWN_FLAG}={overlay.drain_timeout_s}", "-m", TORCHRUN_MODULE,
            f"{CONFIG_MOUNT}/job.yaml", "--wait-timeout-s", str(lease_wait_s(cfg))]


def build_torch_pod(cfg: JobConfig, overlay: Overlay, image: str, place: Placement, container: str) -> dict:
    name = build_kube_name(cfg)
    pod = build_worker_template(cfg, overlay, image, place, name=name, config_map=f"{name}-config",
                                container_name=container, drain=False)
    main = pod["spec"]["containers"][0]
    main["command"] = build_torchrun_command(cfg, overlay)
    # torchrun sets OMP_NUM_THREADS=1 for several ranks a node; each rank's share of the pod's CPUs.
    main["env"].append({"name": "OMP_NUM_THREADS", "value": str(max(1, math.floor(place.pod_cpus
                                                                                    / place.workers_per_pod)))})
    return pod


def build_network_policy(name: str) -> dict:
    """Ingress to the run's pods only from the run's own pods (the rendezvous, NCCL and gloo use
    ports torchrun and the libraries pick). Nothing outside the run talks to a torchrun pod.
    Egress stays open: S3 and the model hub."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{name}-torch", "labels": build_labels(name)},
            "spec": {"podSelector": {"matchLabels": {RUN_LABEL: name}}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": {RUN_LABEL: name}}}]}]}}


def build_training_runtime(cfg: JobConfig, overlay: Overlay, image: str, place: Placement, nodes: int) -> dict:
    name = build_kube_name(cfg)
    pod = build_torch_pod(cfg, overlay, image, place, TRAINJOB_CONTAINER)
    # A failed rank fails its Job at once (backoffLimit 0) and the JobSet restarts every node:
    # a static torchrun group cannot take one node back alone.
    pod["spec"]["restartPolicy"] = "Never"
    job = {"metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
           "spec": {"backoffLimit": 0, "template": pod}}
    return {"apiVersion": TRAINER_API, "kind": "TrainingRuntime",
            "metadata": {"name": f"{name}-torchrun", "labels": dict(build_labels(name),
                                                                     **{f"{TRAINER_GROUP}/framework": "torch"})},
            "spec": {"mlPolicy": {"numNodes": nodes, "torch": {}},
                     "template": {"metadata": {"labels": build_labels(name)},
                                  "spec": {"failurePolicy": {"maxRestarts": RESTARTS},
                                           "replicatedJobs": [{"name": TRAINJOB_STEP, "replicas": 1,
                                                               "template": job}]}}}}


def build_train_job(cfg: JobConfig, overlay: Overlay, place: Placement, nodes: int, runtime: str) -> dict:
    name = build_kube_name(cfg)
    labels = dict(build_labels(name), **({KUEUE_QUEUE_LABEL: overlay.queue} if overlay.queue else {}))
    spec = {"runtimeRef": {"apiGroup": TRAINER_GROUP, "kind": "TrainingRuntime", "name": runtime},
            "trainer": {"numNodes": nodes, "numProcPerNode": place.workers_per_pod},
            "activeDeadlineSeconds": 3 * ONE_DAY_S}
    if overlay.queue:
        spec["suspend"] = True  # Kueue admits the whole gang, then unsuspends
    return {"apiVersion": TRAINER_API, "kind": "TrainJob",
            "metadata": {"name": name, "labels": labels, "annotations": {"eft/run-uri": cfg.run_uri}}, "spec": spec}


def build_pytorch_job(cfg: JobConfig, overlay: Overlay, image: str, place: Placement) -> dict:
    name = build_kube_name(cfg)
    labels = dict(build_labels(name), **({KUEUE_QUEUE_LABEL: overlay.queue} if overlay.queue else {}))
    run_policy = {"cleanPodPolicy": "None", "backoffLimit": RESTARTS, "activeDeadlineSeconds": 3 * ONE_DAY_S,
                  "ttlSecondsAfterFinished": 600}
    if overlay.queue:
        run_policy["suspend"] = True
    return {"apiVersion": PYTORCHJOB_API, "kind": "PyTorchJob",
            "metadata": {"name": name, "labels": labels, "annotations": {"eft/run-uri": cfg.run_uri}},
            "spec": {"nprocPerNode": str(place.workers_per_pod),
                     "elasticPolicy": {"minReplicas": place.min_replicas, "maxReplicas": place.max_replicas,
                                       "rdzvBackend": "c10d", "rdzvPort": RDZV_PORT, "maxRestarts": RESTARTS},
                     "runPolicy": run_policy,
                     # The operator sets the pods' restart policy from the replica's: a failed
                     # torchrun restarts in its pod and rejoins the rendezvous.
                     "pytorchReplicaSpecs": {"Worker": {
                         "replicas": place.max_replicas, "restartPolicy": "OnFailure",
                         "template": build_torch_pod(cfg, overlay, image, place, PYTORCHJOB_CONTAINER)}}}}


def build_kubeflow_manifests(cfg: JobConfig, kind: str, overlay_name: Optional[str], image: Optional[str],
                             node_type: Optional[str] = None) -> dict[str, dict]:
    """file name → manifest. Raises ConfigError (one line, naming the flag or field) if the job
    cannot be placed, before anything is written."""
    if kind not in KUBEFLOW_KINDS:
        raise ConfigError(f"--kubeflow: unknown kind {kind!r} (choose one of {', '.join(KUBEFLOW_KINDS)})")
    overlay = resolve_overlay(overlay_name)
    if not image:
        raise ConfigError("--image: required (a container image with eft installed, pinned by tag)")
    if problem := check_image(image):
        raise ConfigError(f"--image: {problem}")
    if cfg.training.objective == "grpo" and cfg.rl.rollout == "actors":
        raise ConfigError("rl.rollout: actors needs a Ray cluster; under Kubeflow (torchrun) use rl.rollout: colocated")
    place = plan_placement(cfg, resolve_node_type(cfg, overlay, node_type))
    name = build_kube_name(cfg)
    manifests = {"configmap.yaml": build_config_map(cfg, name)}
    if kind == "trainjob":
        runtime = build_training_runtime(cfg, overlay, image, place, place.max_replicas)
        manifests["trainingruntime.yaml"] = runtime
        manifests["trainjob.yaml"] = build_train_job(cfg, overlay, place, place.max_replicas,
                                                     runtime["metadata"]["name"])
    else:
        manifests["pytorchjob.yaml"] = build_pytorch_job(cfg, overlay, image, place)
    manifests["serviceaccount.yaml"] = build_service_account(name, overlay)
    manifests["networkpolicy.yaml"] = build_network_policy(name)
    return manifests
