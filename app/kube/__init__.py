"""KubeRay manifests from a job config (`render`), Kubeflow TrainJob / PyTorchJob manifests running
the same loop under torchrun (`kubeflow`), a RayService serving the run's export
(`service`), the checked-in kustomize tree (`kustomize`), strict validation against the vendored
CRDs (`schema`) and the policy every manifest keeps (`policy`). The names below are the package's
public surface."""

from app.kube.kubeflow import KUBEFLOW_KINDS, build_kubeflow_manifests
from app.kube.kustomize import (BASE_CONFIG, BASE_IMAGE, KUSTOMIZE_OVERLAYS, build_kustomize_tree, build_kustomize_trees,
                                write_kustomize_tree)
from app.kube.policy import (check_documents, check_path, check_policy, describe_worker_fabric, errors_of,
                              render_checked, render_kubeflow_checked, render_service_checked, selects_spot)
from app.kube.render import (OVERLAYS, SAFE_TO_EVICT, SPOT_LABELS, build_kube_name, build_manifests, check_image,
                             dump_manifest, plan_placement, warn_image, write_manifests)
from app.kube.service import (SERVE_CLIENT_LABEL, SERVE_IMAGE, SERVE_PORT, build_service_manifests,
                              build_service_name, resolve_serve_node)
from app.kube.schema import CRD_FILES, DEFAULT_CRD_DIR, ERROR, WARNING, Violation, check_schema, load_schemas
from app.nodes import NODE_TYPES

__all__ = ["KUBEFLOW_KINDS", "build_kubeflow_manifests", "render_kubeflow_checked", "BASE_CONFIG", "BASE_IMAGE", "KUSTOMIZE_OVERLAYS", "build_kustomize_tree", "build_kustomize_trees", "write_kustomize_tree",
           "check_documents", "check_path", "check_policy", "describe_worker_fabric", "errors_of", "render_checked",
           "render_service_checked", "selects_spot", "SERVE_CLIENT_LABEL", "SERVE_IMAGE", "SERVE_PORT",
           "build_service_manifests", "build_service_name", "resolve_serve_node",
           "NODE_TYPES", "OVERLAYS", "SAFE_TO_EVICT", "SPOT_LABELS", "build_kube_name", "build_manifests",
           "check_image", "warn_image", "dump_manifest", "plan_placement", "write_manifests", "CRD_FILES",
           "DEFAULT_CRD_DIR", "ERROR", "WARNING", "Violation", "check_schema", "load_schemas"]
