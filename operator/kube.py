"""A small synchronous client layer over the official client's transport and configuration.

Objects travel as plain dicts (no generated models): what the operator builds is what it
sends, and what the API server returns is compared as it is. Every failure, HTTP or transport,
becomes one `ApiError` with the HTTP status (0 when the server was not reached), which the
handlers turn into kopf's retry or give-up errors.
"""

from __future__ import annotations

import json
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from .objects import Manifest

# kind -> (API prefix, plural); every kind the operator writes.
RESOURCES: dict[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "Secret": ("/api/v1", "secrets"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Event": ("/api/v1", "events"),
    "InferenceService": ("/apis/serving.kvpilot.io/v1alpha1", "inferenceservices"),
    "Pod": ("/api/v1", "pods"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "HorizontalPodAutoscaler": ("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    "ScaledObject": ("/apis/keda.sh/v1alpha1", "scaledobjects"),
    "PodMonitor": ("/apis/monitoring.coreos.com/v1", "podmonitors"),
}
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str = "") -> None:
        super().__init__(f"{status} {reason}: {message}" if message else f"{status} {reason}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def invalid(self) -> bool:
        """The server refused the object itself: retrying the same request cannot help."""
        return self.status in (400, 422)


def _path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    prefix, plural = RESOURCES[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name is not None:
        path += f"/{name}"
    if subresource is not None:
        path += f"/{subresource}"
    return path


class Kube:
    def __init__(self, api_client: client.ApiClient, timeout: float = 30) -> None:
        self._client = api_client
        self._timeout = timeout

    @classmethod
    def from_environment(cls) -> Kube:
        """In a pod, its service account; elsewhere $KUBECONFIG or ~/.kube/config."""
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(client.ApiClient())

    def close(self) -> None:
        self._client.close()

    def _request(self, method: str, path: str, body: Any = None,
                 content_type: str = "application/json", query: list[tuple[str, str]] | None = None) -> Manifest:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        request = self._client.param_serialize(method=method, resource_path=path, header_params=headers,
                                               query_params=query, body=body, auth_settings=["BearerToken"])
        try:
            response = self._client.call_api(*request, _request_timeout=self._timeout)
            response.read()
        except ApiException as exc:  # raised by the transport for e.g. 429 with Retry-After
            raise ApiError(exc.status or 0, str(exc.reason or "ApiException"), str(exc.body or "")) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiError(0, type(exc).__name__, str(exc)) from exc
        data = response.data or b"{}"
        try:
            payload: Manifest = json.loads(data)
        except ValueError:
            payload = {"message": data.decode(errors="replace")[:500]}
        if not 200 <= response.status <= 299:
            raise ApiError(response.status, str(payload.get("reason") or response.reason),
                           str(payload.get("message", "")))
        return payload

    def get(self, kind: str, namespace: str, name: str) -> Manifest | None:
        try:
            return self._request("GET", _path(kind, namespace, name))
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    def list_objects(self, kind: str, namespace: str, selector: str) -> list[Manifest]:
        """The objects of `kind` in `namespace` whose labels match `selector` (k=v,k=v)."""
        return list(self._request("GET", _path(kind, namespace), query=[("labelSelector", selector)]).get("items") or [])

    def api_groups(self) -> Manifest:
        """Discovery: the APIGroupList of `GET /apis` (which groups and versions the cluster serves)."""
        return self._request("GET", "/apis")

    def create(self, obj: Manifest) -> Manifest:
        meta = obj["metadata"]
        return self._request("POST", _path(obj["kind"], meta["namespace"]), obj)

    def replace(self, obj: Manifest) -> Manifest:
        """PUT: the object becomes exactly `obj`; metadata.resourceVersion makes it optimistic."""
        meta = obj["metadata"]
        return self._request("PUT", _path(obj["kind"], meta["namespace"], meta["name"]), obj)

    def patch(self, kind: str, namespace: str, name: str, patch: Manifest | list[Manifest],
              subresource: str | None = None) -> Manifest:
        """A JSON merge patch, or a JSON patch (RFC 6902) when `patch` is a list of operations."""
        content_type = JSON_PATCH if isinstance(patch, list) else MERGE_PATCH
        return self._request("PATCH", _path(kind, namespace, name, subresource), patch, content_type)

    def ping(self, timeout: float) -> bool:
        """The API server answers and says it is ready (`/readyz` is open to every client)."""
        try:
            response = self._client.call_api(*self._client.param_serialize(
                method="GET", resource_path="/readyz", header_params={"Accept": "text/plain"},
                auth_settings=["BearerToken"]), _request_timeout=timeout)
            response.read()
        except (ApiException, urllib3.exceptions.HTTPError, OSError):
            return False
        return 200 <= response.status <= 299

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """True if something was deleted; a missing object is not an error."""
        try:
            self._request("DELETE", _path(kind, namespace, name),
                          {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.not_found:
                return False
            raise
        return True
