"""Kubernetes structural schemas (a CRD's openAPIV3Schema) as JSON Schema, checked the way
`kubectl apply --validate=strict` checks: a field the schema does not declare is an error (the API
server would drop it silently), except under `x-kubernetes-preserve-unknown-fields`."""
from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any

import jsonschema

SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"
KUBERAY_RELEASES = ["v1.5.1", "v1.7.0"]  # the oldest supported and the newest, vendored
PLURAL = {"RayCluster": "rayclusters", "RayJob": "rayjobs"}
KUBERNETES = "v1.33.0"  # the core objects' API version checked (tests/schemas/SOURCES.md)


def strict(schema: Any) -> Any:
    """A copy of `schema` in JSON Schema terms: closed objects, int-or-string, nullable."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    open_ended = out.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in out
    if out.get("type") == "object" and "properties" in out and not open_ended:
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def crd_validator(release: str, kind: str) -> jsonschema.Draft7Validator:
    raw = gzip.decompress((SCHEMAS / f"kuberay-{release}" / f"{PLURAL[kind]}.json.gz").read_bytes())
    return jsonschema.Draft7Validator(strict(json.loads(raw)))


@functools.lru_cache(maxsize=1)
def _kubernetes_definitions() -> dict:
    return json.loads(gzip.decompress((SCHEMAS / f"kubernetes-{KUBERNETES}.json.gz").read_bytes()))


def core_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    """The Kubernetes definition of `kind` (Deployment, Service, ...) in `api_version` (v1, apps/v1,
    networking.k8s.io/v1, ...), strict as vendored; references resolve inside the same document."""
    document = _kubernetes_definitions()
    group, _, version = api_version.rpartition("/")
    group = {"": "core"}.get(group, group.removesuffix(".k8s.io"))
    name = f"io.k8s.api.{group}.{version}.{kind}"
    if name not in document["$defs"]:
        raise KeyError(f"no {name} in the Kubernetes {KUBERNETES} definitions")
    return jsonschema.Draft202012Validator({**document, "$ref": f"#/$defs/{name}"})


def errors(validator: jsonschema.protocols.Validator, doc: dict) -> list[str]:
    """Each error as `path: message`, the path in the manifest's own keys."""
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}"
            for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]
