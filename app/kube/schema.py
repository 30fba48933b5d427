"""Manifests validated against the vendored CRDs' (KubeRay, Kubeflow) openAPIV3Schema with unknown fields as errors,
like `kubectl apply --validate=strict`. Each problem is a `Violation`:
`<manifest>: <field path>: <message>`."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

from app.config import ConfigError

# Vendored KubeRay v1.7.0, Kubeflow Trainer v2.3.0 and Training Operator v1.9.4 CRDs, shipped as
# package data (see crds/README.md).
DEFAULT_CRD_DIR = Path(__file__).resolve().parent / "crds"
CRD_FILES = ("ray.io_rayclusters.yaml", "ray.io_rayjobs.yaml", "ray.io_rayservices.yaml",
             "trainer.kubeflow.org_trainjobs.yaml", "trainer.kubeflow.org_trainingruntimes.yaml",
             "trainer.kubeflow.org_clustertrainingruntimes.yaml", "kubeflow.org_pytorchjobs.yaml")

ERROR = "error"
WARNING = "warning"


@dataclass(frozen=True)
class Violation:
    manifest: str
    field: str
    message: str
    # Errors fail `eft manifests` and `--check`; warnings are printed and pass.
    severity: str = ERROR

    def __str__(self) -> str:
        note = "warning: " if self.severity == WARNING else ""
        return f"{self.manifest}: {self.field}: {note}{self.message}"


# Top-level ObjectMeta is validated by the API server itself, not by the CRD; these are its
# fields a manifest may set.
OBJECT_META = {"type": "object", "additionalProperties": False, "properties": {
    "name": {"type": "string"}, "generateName": {"type": "string"}, "namespace": {"type": "string"},
    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    "finalizers": {"type": "array", "items": {"type": "string"}},
    "ownerReferences": {"type": "array", "items": {"type": "object"}},
}}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
LABEL_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": STRING_MAP,
    "matchExpressions": {"type": "array", "items": {
        "type": "object", "additionalProperties": False, "required": ["key", "operator"], "properties": {
            "key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
            "values": {"type": "array", "items": {"type": "string"}}}}}}}
INT_OR_STRING = {"anyOf": [{"type": "integer"}, {"type": "string"}]}


def builtin_schema(api_version: str, kind: str, **fields) -> dict:
    """A core kind the KubeRay CRDs do not describe, with only the fields eft renders (plus the
    obvious ones) and unknown fields as errors."""
    return {"type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata"],
            "properties": {"apiVersion": {"enum": [api_version]}, "kind": {"enum": [kind]}, "metadata": OBJECT_META,
                           **fields}}


SERVICE_ACCOUNT_SCHEMA = builtin_schema(
    "v1", "ServiceAccount", automountServiceAccountToken={"type": "boolean"},
    imagePullSecrets={"type": "array", "items": {"type": "object", "additionalProperties": False,
                                                 "properties": {"name": {"type": "string"}}}})
NETWORK_POLICY_PEER = {"type": "object", "additionalProperties": False, "properties": {
    "podSelector": LABEL_SELECTOR, "namespaceSelector": LABEL_SELECTOR,
    "ipBlock": {"type": "object", "additionalProperties": False, "required": ["cidr"], "properties": {
        "cidr": {"type": "string"}, "except": {"type": "array", "items": {"type": "string"}}}}}}
NETWORK_POLICY_PORT = {"type": "object", "additionalProperties": False, "properties": {
    "protocol": {"enum": ["TCP", "UDP", "SCTP"]}, "port": INT_OR_STRING, "endPort": {"type": "integer"}}}
NETWORK_POLICY_SCHEMA = builtin_schema("networking.k8s.io/v1", "NetworkPolicy", spec={
    "type": "object", "additionalProperties": False, "required": ["podSelector"], "properties": {
        "podSelector": LABEL_SELECTOR,
        "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}},
        "ingress": {"type": "array", "items": {"type": "object", "additionalProperties": False, "properties": {
            "from": {"type": "array", "items": NETWORK_POLICY_PEER},
            "ports": {"type": "array", "items": NETWORK_POLICY_PORT}}}},
        "egress": {"type": "array", "items": {"type": "object", "additionalProperties": False, "properties": {
            "to": {"type": "array", "items": NETWORK_POLICY_PEER},
            "ports": {"type": "array", "items": NETWORK_POLICY_PORT}}}}}})
NETWORK_POLICY_SCHEMA["required"].append("spec")
PDB_SCHEMA = builtin_schema("policy/v1", "PodDisruptionBudget", spec={
    "type": "object", "additionalProperties": False, "required": ["selector"], "properties": {
        "selector": LABEL_SELECTOR, "minAvailable": INT_OR_STRING, "maxUnavailable": INT_OR_STRING,
        "unhealthyPodEvictionPolicy": {"enum": ["IfHealthyBudget", "AlwaysAllow"]}}})
PDB_SCHEMA["required"].append("spec")
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
    """(apiVersion, kind) → strict JSON Schema, from the vendored CRDs plus built-in ConfigMap,
    ServiceAccount, NetworkPolicy and PodDisruptionBudget schemas."""
    return _load_schemas(Path(crd_dir or DEFAULT_CRD_DIR).resolve())


@functools.lru_cache(maxsize=4)  # the CRDs are 2 MB of YAML; parse them once per process
def _load_schemas(crd_dir: Path) -> dict[tuple[str, str], dict]:
    if not crd_dir.is_dir():
        raise ConfigError(f"--crd-dir: {crd_dir}: CRD directory not found "
                          f"(expected {', '.join(CRD_FILES)})")
    schemas = {("v1", "ConfigMap"): CONFIG_MAP_SCHEMA, ("v1", "ServiceAccount"): SERVICE_ACCOUNT_SCHEMA,
               ("networking.k8s.io/v1", "NetworkPolicy"): NETWORK_POLICY_SCHEMA,
               ("policy/v1", "PodDisruptionBudget"): PDB_SCHEMA}
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
