"""Render the k8s/ overlays with kubectl and turn their containers into local processes.

`render(overlay)` runs `kubectl kustomize k8s/overlays/<overlay>` and returns the parsed objects.
`local_process_specs(objects, pdserve=...)` reads every Deployment's container the way a kubelet
would (ConfigMap/Secret `envFrom`, `env` with `$(VAR)` expansion, downward-API fields) and
rewrites what only exists inside a cluster for one loopback host: the pod IP and service DNS
names become 127.0.0.1, and every container port of every replica is remapped to a free local
port (so two replicas of one Deployment can run side by side). A worker's `dns://NAME:PORT`
becomes what NAME resolves to in a cluster: every selected replica for a headless Service (a
comma-separated list of tcp:// addresses), the one Service address otherwise. The result is what
tests/k8s/test_processes.py starts with `.venv/bin/pdserve`.
"""

from __future__ import annotations

import base64
import re
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdserve.config.ports import free_port
from tests.helpers.paths import REPO

K8S_DIR = REPO / "k8s"
LOCAL_HOST = "127.0.0.1"
# What spec.nodeName reads as on the loopback host: every local process shares one "node".
LOCAL_NODE_NAME = "local-node"
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_HOST_PORT = re.compile(r"(?P<host>[A-Za-z0-9_.\-]+):(?P<port>\d+)")
_DNS_ADDRESS = re.compile(r"^dns://(?P<host>[A-Za-z0-9_.\-]+):(?P<port>\d+)$")
_WORKLOAD_KINDS = ("Deployment", "StatefulSet")
_LOCAL_SECRET = secrets.token_hex(32)
# The Secrets docs/kubernetes.md has the operator create before the manifests are applied (the
# manifests ship none), stood in for with a random deployment secret per test session.
OPERATOR_SECRETS: dict[str, dict[str, str]] = {"pdserve-internal": {"secret": _LOCAL_SECRET}}


def kubectl() -> str:
    """Path of the kubectl binary (its built-in kustomize renders the overlays)."""
    path = shutil.which("kubectl") or "/usr/bin/kubectl"
    if not Path(path).exists():
        raise RuntimeError("kubectl is not installed; it renders k8s/ with `kubectl kustomize`")
    return path


def render(overlay: str) -> list[dict[str, Any]]:
    """`kubectl kustomize k8s/overlays/<overlay>`, parsed into one dict per object."""
    path = K8S_DIR / "overlays" / overlay
    proc = subprocess.run(
        [kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {path} failed:\n{proc.stderr}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def objects_of_kind(objects: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def get_object(objects: Iterable[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for o in objects:
        if o["kind"] == kind and o["metadata"]["name"] == name:
            return o
    raise KeyError(f"no {kind}/{name} in the rendered objects")


def labels_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels and matchExpressions) selects these labels."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One container of one replica, as a local process: argv, its own env, its local ports."""

    name: str  # "<workload>-<replica index>"
    component: str  # app.kubernetes.io/component of the pod
    argv: tuple[str, ...]
    env: dict[str, str]
    ports: dict[str, int]  # container port name -> local port
    container_ports: dict[int, int]  # container port number -> local port
    probes: dict[str, str] = field(default_factory=dict)  # probe kind -> local http URL


@dataclass(frozen=True, slots=True)
class _Replica:
    workload: dict[str, Any]
    index: int
    container_ports: dict[int, int]  # container port number -> local port (all containers)
    port_names: dict[str, int]  # container port name -> container port number


def _decode_secret(secret: dict[str, Any]) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    data.update(secret.get("stringData") or {})
    return data


def _secrets(objects: list[dict[str, Any]], operator: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The Secrets a pod can read: those the operator created, then any the manifests define."""
    return {**operator, **{o["metadata"]["name"]: _decode_secret(o) for o in objects_of_kind(objects, "Secret")}}


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: defined names are replaced, unknown ones kept as written."""
    return _VAR_REF.sub(
        lambda m: env.get(m.group(1), m.group(0)), value.replace("$$", "\0")
    ).replace("\0", "$")


def _pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def _pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels") or {}


def _resolve_port(replica: _Replica, port: int | str) -> int:
    """A probe's or Service's target port (a number or a container port name) -> local port."""
    number = replica.port_names[port] if isinstance(port, str) else int(port)
    if number not in replica.container_ports:
        raise ValueError(
            f"{replica.workload['metadata']['name']}: port {port!r} is not a declared containerPort"
        )
    return replica.container_ports[number]


class _ServiceMap:
    """Service DNS name + service port -> the local port of the first replica it selects (what a
    connection through its virtual IP reaches), and every selected replica's (what the name of a
    headless Service resolves to)."""

    def __init__(self, services: list[dict[str, Any]], replicas: list[_Replica]) -> None:
        self._targets: dict[tuple[str, int], list[int]] = {}
        for svc in services:
            meta = svc["metadata"]
            name, ns = meta["name"], meta.get("namespace", "default")
            names = (name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local")
            selector = {"matchLabels": svc["spec"].get("selector") or {}}
            chosen = [r for r in replicas if labels_match(selector, _pod_labels(r.workload))]
            if not chosen:
                continue
            if svc["spec"].get("clusterIP") != "None":
                chosen = chosen[:1]
            for p in svc["spec"]["ports"]:
                local = [_resolve_port(r, p.get("targetPort", p["port"])) for r in chosen]
                for dns in names:
                    self._targets[(dns, int(p["port"]))] = local

    def lookup(self, host: str, port: int) -> int | None:
        found = self._targets.get((host, port))
        return found[0] if found else None

    def resolve(self, host: str, port: int) -> list[int]:
        """The local ports `host` resolves to as a DNS name, with the service port `port`."""
        return self._targets.get((host, port), [])


def _localize(value: str, key: str, own: _Replica, services: _ServiceMap, pod_ip: str) -> str:
    """Rewrite one env value or argument for the loopback host."""
    if value == "0.0.0.0":
        return LOCAL_HOST  # tests bind loopback only

    def host_port(m: re.Match[str]) -> str:
        host, port = m.group("host"), int(m.group("port"))
        via_service = services.lookup(host, port)
        if via_service is not None:
            return f"{LOCAL_HOST}:{via_service}"
        if host in (pod_ip, LOCAL_HOST, "0.0.0.0", "localhost") and port in own.container_ports:
            return f"{LOCAL_HOST}:{own.container_ports[port]}"
        raise ValueError(f"{key}={value!r}: {host}:{port} is neither a Service nor this pod's port")

    def item(text: str) -> str:
        m = _DNS_ADDRESS.match(text)
        if m is None:
            return _HOST_PORT.sub(host_port, text)
        ports = services.resolve(m.group("host"), int(m.group("port")))
        if not ports:
            raise ValueError(f"{key}={value!r}: {m.group('host')}:{m.group('port')} names no Service port")
        return ",".join(f"tcp://{LOCAL_HOST}:{p}" for p in ports)

    value = ",".join(item(part) for part in value.split(","))
    if key.endswith("_PORT") and value.isdigit():
        port = int(value)
        if port not in own.container_ports:
            raise ValueError(f"{key}={value} is not one of the pod's containerPorts")
        return str(own.container_ports[port])
    return value


def _field_ref(path: str, replica: _Replica, pod_ip: str) -> str:
    meta = replica.workload["metadata"]
    fields = {
        "status.podIP": pod_ip,
        "status.hostIP": pod_ip,
        "spec.nodeName": LOCAL_NODE_NAME,
        "metadata.name": f"{meta['name']}-{replica.index}",
        "metadata.uid": f"uid-{meta['name']}-{replica.index}",
        "metadata.namespace": meta.get("namespace", "default"),
        "spec.serviceAccountName": "default",
    }
    if path not in fields:
        raise ValueError(f"downward API field {path!r} has no local stand-in")
    return fields[path]


def _container_env(
    container: dict[str, Any],
    replica: _Replica,
    config_maps: dict[str, dict[str, str]],
    secrets: dict[str, dict[str, str]],
    pod_ip: str,
) -> dict[str, str]:
    """The env a kubelet would give this container (envFrom first, then env in order)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        ref = source.get("configMapRef") or source.get("secretRef")
        table = config_maps if "configMapRef" in source else secrets
        if ref["name"] not in table:
            if ref.get("optional"):
                continue
            raise KeyError(f"envFrom names {ref['name']!r}, which the manifests do not define")
        env.update({prefix + k: v for k, v in table[ref["name"]].items()})
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item:
            env[name] = _expand(str(item["value"]), env)
            continue
        src = item.get("valueFrom") or {}
        if "fieldRef" in src:
            env[name] = _field_ref(src["fieldRef"]["fieldPath"], replica, pod_ip)
        elif "configMapKeyRef" in src or "secretKeyRef" in src:
            ref = src.get("configMapKeyRef") or src["secretKeyRef"]
            table = config_maps if "configMapKeyRef" in src else secrets
            data = table.get(ref["name"])
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    continue
                raise KeyError(f"{name}: {ref['name']}/{ref['key']} is not defined")
            env[name] = data[ref["key"]]
        elif "resourceFieldRef" in src:
            resource = src["resourceFieldRef"]["resource"].split(".", 1)[1]
            env[name] = str((container.get("resources") or {}).get("limits", {}).get(resource, ""))
        else:
            raise ValueError(f"{name}: unsupported valueFrom {sorted(src)}")
    return env


def local_process_specs(
    objects: list[dict[str, Any]],
    *,
    pdserve: str,
    replicas: dict[str, int] | None = None,
    port_allocator: Callable[[], int] = free_port,
    operator_secrets: dict[str, dict[str, str]] = OPERATOR_SECRETS,
) -> list[ProcessSpec]:
    """Every container of every replica of the rendered workloads, as local process specs.

    `replicas` overrides a workload's `spec.replicas` by name. The container's `pdserve` command
    becomes `pdserve` (a path). Specs come in manifest order, replicas in index order. A pod that
    reads a Secret neither `operator_secrets` nor the manifests define raises KeyError (a kubelet
    would not start it).
    """
    config_maps = {
        o["metadata"]["name"]: dict(o.get("data") or {})
        for o in objects_of_kind(objects, "ConfigMap")
    }
    secrets = _secrets(objects, operator_secrets)
    workloads = [o for o in objects if o["kind"] in _WORKLOAD_KINDS]
    taken: set[int] = set()

    def distinct_port() -> int:
        # The kernel may hand a just-released port out again; two replicas must never share one.
        for _ in range(100):
            port = port_allocator()
            if port not in taken:
                taken.add(port)
                return port
        raise RuntimeError("the port allocator keeps returning ports already taken")

    all_replicas: list[_Replica] = []
    for w in workloads:
        count = (replicas or {}).get(w["metadata"]["name"], w["spec"].get("replicas", 1))
        containers = _pod_spec(w)["containers"]
        declared = [p for c in containers for p in c.get("ports") or []]
        for i in range(count):
            all_replicas.append(
                _Replica(
                    workload=w,
                    index=i,
                    container_ports={int(p["containerPort"]): distinct_port() for p in declared},
                    port_names={
                        p["name"]: int(p["containerPort"]) for p in declared if "name" in p
                    },
                )
            )
    services = _ServiceMap(objects_of_kind(objects, "Service"), all_replicas)
    specs: list[ProcessSpec] = []
    for r in all_replicas:
        for container in _pod_spec(r.workload)["containers"]:
            specs.append(_container_spec(r, container, config_maps, secrets, services, pdserve))
    return specs


def pod_env(
    objects: list[dict[str, Any]],
    workload_name: str,
    *,
    pod_ip: str = "10.0.0.7",
    operator_secrets: dict[str, dict[str, str]] = OPERATOR_SECRETS,
) -> dict[str, str]:
    """The env the first container of a workload gets in a cluster (ports as declared), with the
    Secrets in `operator_secrets` created."""
    workload = next(
        o
        for o in objects
        if o["kind"] in _WORKLOAD_KINDS and o["metadata"]["name"] == workload_name
    )
    containers = _pod_spec(workload)["containers"]
    declared = [p for c in containers for p in c.get("ports") or []]
    replica = _Replica(
        workload=workload,
        index=0,
        container_ports={int(p["containerPort"]): int(p["containerPort"]) for p in declared},
        port_names={p["name"]: int(p["containerPort"]) for p in declared if "name" in p},
    )
    config_maps = {
        o["metadata"]["name"]: dict(o.get("data") or {})
        for o in objects_of_kind(objects, "ConfigMap")
    }
    secrets = _secrets(objects, operator_secrets)
    return _container_env(containers[0], replica, config_maps, secrets, pod_ip)


def _container_spec(
    replica: _Replica,
    container: dict[str, Any],
    config_maps: dict[str, dict[str, str]],
    secrets: dict[str, dict[str, str]],
    services: _ServiceMap,
    pdserve: str,
) -> ProcessSpec:
    pod_ip = LOCAL_HOST
    raw_env = _container_env(container, replica, config_maps, secrets, pod_ip)
    env = {k: _localize(v, k, replica, services, pod_ip) for k, v in raw_env.items()}
    argv = [
        _expand(a, raw_env)
        for a in (container.get("command") or []) + (container.get("args") or [])
    ]
    if not argv or argv[0] != "pdserve":
        raise ValueError(
            f"{replica.workload['metadata']['name']}: command must start with pdserve, got {argv}"
        )
    argv = [pdserve] + [_localize(a, "", replica, services, pod_ip) for a in argv[1:]]
    probes = {}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = (container.get(kind) or {}).get("httpGet")
        if get:
            probes[kind] = (
                f"http://{LOCAL_HOST}:{_resolve_port(replica, get['port'])}{get.get('path', '/')}"
            )
    names = {n: replica.container_ports[num] for n, num in replica.port_names.items()}
    return ProcessSpec(
        name=f"{replica.workload['metadata']['name']}-{replica.index}",
        component=_pod_labels(replica.workload).get("app.kubernetes.io/component", ""),
        argv=tuple(argv),
        env=env,
        ports=names,
        container_ports=dict(replica.container_ports),
        probes=probes,
    )
