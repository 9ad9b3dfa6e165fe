"""The k8s/ overlays render, pass strict schema validation, and keep the promises of
docs/kubernetes.md: pod security, probes that mean what they say, Guaranteed QoS, graceful
drain, disruption budgets, network isolation of the ZMQ ports, autoscaling on router metrics.

Nothing is applied: `kubectl kustomize` renders, `kubernetes_validate` checks each object
against the Kubernetes OpenAPI schemas it ships, and the assertions read the rendered objects.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import re
from typing import Any

import kubernetes_validate
import pytest

from pdserve.config import envs
from pdserve.config.engine import ConfigError
from pdserve.config.router import router_config
from pdserve.protocol.block_hash import hash_blocks
from pdserve.protocol.messages import Register
from pdserve.router.cli import add_arguments as add_router_cli_arguments
from pdserve.router.registry import Registry
from tests.helpers.fake_worker import FINGERPRINT
from tests.helpers.k8s_render import (
    OPERATOR_SECRETS,
    REPO,
    get_object,
    labels_match,
    local_process_specs,
    objects_of_kind,
    pod_env,
    render,
)
from tests.helpers.paths import package_folders

OVERLAYS = ("cpu", "gpu")
# Oldest release still widely run that has everything used here (matchLabelKeys in topology
# spread, autoscaling/v2, policy/v1); the schemas ship with kubernetes-validate.
K8S_VERSION = "1.30.0"
WORKERS = ("pdserve-prefill", "pdserve-decode")
WORKLOADS = ("pdserve-router", *WORKERS)
PART_OF = {"app.kubernetes.io/part-of": "pdserve"}
UID = 10001


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


@pytest.fixture(scope="module")
def cpu() -> list[dict[str, Any]]:
    return render("cpu")


@pytest.fixture(scope="module")
def gpu() -> list[dict[str, Any]]:
    return render("gpu")


def _workloads(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def _pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    pod = _pod(workload)
    return pod["containers"] + pod.get("initContainers", [])


def _port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p.get("name") == port)


def _prestop_seconds(container: dict[str, Any]) -> int:
    hook = (container.get("lifecycle") or {}).get("preStop")
    if not hook:
        return 0
    if "sleep" in hook:
        return int(hook["sleep"]["seconds"])
    command = hook.get("exec", {}).get("command", [])
    if command[:1] == ["sleep"]:
        return int(command[1])
    raise AssertionError(f"preStop hook {hook} has no countable duration")


# --- rendering and schema -------------------------------------------------------------------


def test_overlay_renders_objects_that_pass_strict_schema_validation(overlay):
    name, objs = overlay
    assert {o["kind"] for o in objs} >= {
        "Namespace",
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "HorizontalPodAutoscaler",
    }
    for obj in objs:
        # SchemaNotFoundError (an unknown kind or apiVersion) fails the test as well.
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_strict_validation_rejects_a_misspelled_field(cpu):
    broken = copy.deepcopy(get_object(cpu, "Deployment", "pdserve-decode"))
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_each_overlay_runs_router_prefill_and_decode_deployments(overlay):
    _, objs = overlay
    assert sorted(w["metadata"]["name"] for w in _workloads(objs)) == sorted(WORKLOADS)
    assert all(w["metadata"]["namespace"] == "pdserve" for w in _workloads(objs))


# --- pod security ---------------------------------------------------------------------------


def test_every_container_runs_as_non_root_without_privileges(overlay):
    _, objs = overlay
    for w in _workloads(objs):
        pod_sc = _pod(w)["securityContext"]
        assert pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
        for c in _containers(w):
            sc = c["securityContext"]
            where = f"{w['metadata']['name']}/{c['name']}"
            assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, where
            assert sc.get("runAsUser", pod_sc.get("runAsUser")) == UID, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc.get("privileged", False) is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert not sc["capabilities"].get("add"), where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc.get("seccompProfile", pod_sc["seccompProfile"])["type"] == "RuntimeDefault"


def test_pods_share_no_host_namespace_path_or_port(overlay):
    _, objs = overlay
    for w in _workloads(objs):
        pod = _pod(w)
        for key in ("hostNetwork", "hostIPC", "hostPID"):
            assert pod.get(key, False) is False, key
        assert not [v for v in pod.get("volumes", []) if "hostPath" in v]
        assert not [p for c in _containers(w) for p in c.get("ports", []) if "hostPort" in p]


def test_pods_do_not_mount_the_api_token_nor_get_service_env_links(overlay):
    # Service links would inject PDSERVE_ROUTER_PORT=tcp://... and the like: the CLI's env prefix.
    _, objs = overlay
    for w in _workloads(objs):
        assert _pod(w)["automountServiceAccountToken"] is False
        assert _pod(w)["enableServiceLinks"] is False


def test_read_only_root_has_writable_tmp_and_workers_have_memory_backed_shm(overlay):
    _, objs = overlay
    for w in _workloads(objs):
        volumes = {v["name"]: v for v in _pod(w)["volumes"]}
        for c in _containers(w):
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert "emptyDir" in volumes[mounts["/tmp"]]
            if w["metadata"]["name"] in WORKERS:
                shm = volumes[mounts["/dev/shm"]]["emptyDir"]
                assert shm["medium"] == "Memory" and shm["sizeLimit"]


# --- configuration and probes ---------------------------------------------------------------


def test_workers_bind_and_advertise_the_pod_ip(overlay):
    _, objs = overlay
    for name in WORKERS:
        env = pod_env(objs, name, pod_ip="10.9.8.7")
        assert env["PDSERVE_HOST"] == env["PDSERVE_ADVERTISE_HOST"] == "10.9.8.7"
        assert env["PDSERVE_ROUTER_ADDRESS"] == "dns://pdserve-router-headless:5550"


def test_router_control_binds_the_pod_ip_on_its_declared_port(overlay):
    _, objs = overlay
    env = pod_env(objs, "pdserve-router", pod_ip="10.9.8.7")
    router = _containers(get_object(objs, "Deployment", "pdserve-router"))[0]
    assert env["PDSERVE_CONTROL_ADDRESS"] == f"tcp://10.9.8.7:{_port_number(router, 'control')}"
    assert int(env["PDSERVE_PORT"]) == _port_number(router, "http")


def test_configured_ports_are_exactly_the_declared_container_ports(overlay):
    _, objs = overlay
    for w in _workloads(objs):
        env = pod_env(objs, w["metadata"]["name"])
        configured = {int(v) for k, v in env.items() if k.endswith("_PORT")}
        configured |= {
            int(m.group(1))
            for k, v in env.items()
            if k.endswith("_ADDRESS") and k != "PDSERVE_ROUTER_ADDRESS"
            for m in [re.search(r":(\d+)$", v)]
            if m
        }
        declared = {p["containerPort"] for c in _containers(w) for p in c["ports"]}
        assert configured == declared, w["metadata"]["name"]


def test_probes_mean_ready_and_alive_on_the_serving_port(overlay):
    _, objs = overlay
    for w in _workloads(objs):
        name = w["metadata"]["name"]
        env = pod_env(objs, name)
        serving_port = int(
            env["PDSERVE_PORT"] if name == "pdserve-router" else env["PDSERVE_HEALTH_PORT"]
        )
        c = _containers(w)[0]
        paths = {"startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"}
        for kind, path in paths.items():
            get = c[kind]["httpGet"]
            assert get["path"] == path, f"{name} {kind}"
            assert _port_number(c, get["port"]) == serving_port, f"{name} {kind}"
        # Liveness must not be the readiness check: losing the router must not restart workers.
        assert c["livenessProbe"]["httpGet"]["path"] != "/ready"


def test_every_container_has_requests_equal_to_limits(overlay):
    _, objs = overlay
    for w in _workloads(objs):
        for c in _containers(w):
            res = c["resources"]
            assert {"cpu", "memory"} <= set(res["limits"]), c["name"]
            assert res["requests"] == res["limits"], w["metadata"]["name"]


def test_cpu_overlay_gives_each_worker_one_cpu_and_one_thread(cpu):
    for name in WORKERS:
        c = _containers(get_object(cpu, "Deployment", name))[0]
        assert c["resources"]["limits"]["cpu"] == "1"
        assert pod_env(cpu, name)["PDSERVE_THREADS"] == "1"


def test_grace_period_outlasts_prestop_plus_drain(overlay):
    _, objs = overlay
    for w in _workloads(objs):
        drain = float(pod_env(objs, w["metadata"]["name"])["PDSERVE_DRAIN_TIMEOUT"])
        prestop = max(_prestop_seconds(c) for c in _containers(w))
        assert _pod(w)["terminationGracePeriodSeconds"] > prestop + drain, w["metadata"]["name"]


def test_router_waits_for_endpoint_removal_before_draining(overlay):
    _, objs = overlay
    router = _containers(get_object(objs, "Deployment", "pdserve-router"))[0]
    assert _prestop_seconds(router) > 0


def test_workers_spread_over_nodes(overlay):
    _, objs = overlay
    for name in WORKERS:
        w = get_object(objs, "Deployment", name)
        spread = {t["topologyKey"]: t for t in _pod(w)["topologySpreadConstraints"]}
        node = spread["kubernetes.io/hostname"]
        assert labels_match(node["labelSelector"], _pod_labels(w))
        assert node["maxSkew"] == 1


# --- services and network -------------------------------------------------------------------


def test_only_the_router_http_port_is_reachable_from_outside(overlay):
    _, objs = overlay
    router = _containers(get_object(objs, "Deployment", "pdserve-router"))[0]
    external = [
        s
        for s in objects_of_kind(objs, "Service")
        if s["spec"].get("type") in ("LoadBalancer", "NodePort")
    ]
    assert [s["metadata"]["name"] for s in external] == ["pdserve-router"]
    for svc in external:
        targets = {_port_number(router, p["targetPort"]) for p in svc["spec"]["ports"]}
        assert targets == {_port_number(router, "http")}


def test_control_service_is_internal_and_reaches_a_router_that_is_not_ready_yet(overlay):
    # The router turns ready only after workers registered through this Service.
    _, objs = overlay
    svc = get_object(objs, "Service", "pdserve-router-control")
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert labels_match(
        {"matchLabels": svc["spec"]["selector"]},
        _pod_labels(get_object(objs, "Deployment", "pdserve-router")),
    )


def test_two_routers_serve_behind_the_http_service_and_a_budget_keeps_one_up(overlay):
    _, objs = overlay
    router = get_object(objs, "Deployment", "pdserve-router")
    assert router["spec"]["replicas"] == 2
    http = get_object(objs, "Service", "pdserve-router")
    assert labels_match({"matchLabels": http["spec"]["selector"]}, _pod_labels(router))
    [budget] = [p for p in objects_of_kind(objs, "PodDisruptionBudget")
                if labels_match(p["spec"]["selector"], _pod_labels(router))]
    assert budget["spec"] == {"minAvailable": 1, "selector": budget["spec"]["selector"]}
    # A rollout surges a new router before an old one goes: never fewer than the replicas.
    rolling = router["spec"]["strategy"]
    assert rolling["type"] == "RollingUpdate" and rolling["rollingUpdate"]["maxUnavailable"] == 0


def test_workers_register_with_every_router_pod_through_a_headless_service(overlay):
    from pdserve.config.router_address import RouterAddress, parse_router_addresses

    _, objs = overlay
    router = get_object(objs, "Deployment", "pdserve-router")
    headless = get_object(objs, "Service", "pdserve-router-headless")
    spec = headless["spec"]
    assert spec["clusterIP"] == "None" and spec.get("type", "ClusterIP") == "ClusterIP"
    # Router pods resolve before they are ready: they turn ready once workers registered.
    assert spec["publishNotReadyAddresses"] is True
    assert labels_match({"matchLabels": spec["selector"]}, _pod_labels(router))
    [port] = spec["ports"]
    control = _port_number(_containers(router)[0], "control")
    assert _port_number(_containers(router)[0], port["targetPort"]) == control == port["port"]
    for name in WORKERS:
        env = pod_env(objs, name)
        assert parse_router_addresses(env["PDSERVE_ROUTER_ADDRESS"]) == (
            RouterAddress("dns", "pdserve-router-headless", port["port"]),)
        assert float(env["PDSERVE_ROUTER_RESOLVE_INTERVAL"]) > 0


def test_autoscalers_use_per_router_request_counts_that_sum_over_router_pods(overlay):
    # Each request belongs to one router, so these sum across routers; worker-side gauges (KV
    # blocks), reported by every router for every worker, would count each worker twice.
    _, objs = overlay
    per_router = {"pdserve_router_queue_depth", "pdserve_router_running_requests"}
    for hpa in objects_of_kind(objs, "HorizontalPodAutoscaler"):
        for m in hpa["spec"]["metrics"]:
            assert m["type"] == "Object" and m["object"]["metric"]["name"] in per_router, hpa["metadata"]["name"]
            assert m["object"]["describedObject"]["name"] == "pdserve-router"
            assert m["object"]["target"]["type"] == "AverageValue"


def _ingress_sources(objs: list[dict[str, Any]], labels: dict[str, str], port: int) -> list[Any]:
    """`from` lists of every ingress rule that admits traffic to `port` of a pod with `labels`.

    None stands for "from anywhere" (a rule without `from`).
    """
    sources: list[Any] = []
    for pol in objects_of_kind(objs, "NetworkPolicy"):
        if (
            not labels_match(pol["spec"]["podSelector"], labels)
            or "Ingress" not in pol["spec"]["policyTypes"]
        ):
            continue
        for rule in pol["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is None or any(p.get("port") == port for p in ports):
                sources.append(rule.get("from"))
    return sources


def test_every_pod_is_isolated_by_some_network_policy(overlay):
    _, objs = overlay
    for w in _workloads(objs):
        assert any(
            labels_match(p["spec"]["podSelector"], _pod_labels(w))
            for p in objects_of_kind(objs, "NetworkPolicy")
        ), w["metadata"]["name"]


def test_internal_ports_admit_only_pdserve_pods(overlay):
    _, objs = overlay
    for w in _workloads(objs):
        labels = _pod_labels(w)
        assert labels_match({"matchLabels": PART_OF}, labels)
        for c in _containers(w):
            for p in c["ports"]:
                if w["metadata"]["name"] == "pdserve-router" and p["name"] == "http":
                    continue
                sources = _ingress_sources(objs, labels, p["containerPort"])
                assert sources, f"{w['metadata']['name']}:{p['containerPort']} admits nothing"
                for peers in sources:
                    assert peers, f"{w['metadata']['name']}:{p['containerPort']} is open to anyone"
                    for peer in peers:
                        assert set(peer) == {"podSelector"}, peer
                        assert peer["podSelector"] == {"matchLabels": PART_OF}


def test_router_http_port_admits_anyone(overlay):
    _, objs = overlay
    router = get_object(objs, "Deployment", "pdserve-router")
    http = _port_number(_containers(router)[0], "http")
    assert None in _ingress_sources(objs, _pod_labels(router), http)


# --- disruption and autoscaling -------------------------------------------------------------


def test_each_workload_has_one_disruption_budget_that_allows_drains(overlay):
    _, objs = overlay
    pdbs = objects_of_kind(objs, "PodDisruptionBudget")
    for w in _workloads(objs):
        mine = [p for p in pdbs if labels_match(p["spec"]["selector"], _pod_labels(w))]
        assert len(mine) == 1, w["metadata"]["name"]
        spec = mine[0]["spec"]
        if "maxUnavailable" in spec:
            assert spec["maxUnavailable"] >= 1
        else:
            assert spec["minAvailable"] < w["spec"]["replicas"]
    for p in pdbs:  # and no budget selects two workloads
        assert (
            sum(labels_match(p["spec"]["selector"], _pod_labels(w)) for w in _workloads(objs)) == 1
        )


def test_autoscalers_scale_workers_on_router_metrics_not_cpu(overlay):
    _, objs = overlay
    hpas = {
        h["spec"]["scaleTargetRef"]["name"]: h
        for h in objects_of_kind(objs, "HorizontalPodAutoscaler")
    }
    assert set(hpas) == set(WORKERS)
    for target, hpa in hpas.items():
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment")
        get_object(objs, "Deployment", target)
        for m in hpa["spec"]["metrics"]:
            assert m["type"] in ("Pods", "Object", "External")
            if m["type"] == "Object":
                described = m["object"]["describedObject"]
                get_object(objs, described["kind"], described["name"])
        assert hpa["spec"]["minReplicas"] >= 2  # keeps the PDB's one-at-a-time drain possible
    names = [m["object"]["metric"]["name"] for m in hpas["pdserve-prefill"]["spec"]["metrics"]]
    assert names == ["pdserve_router_queue_depth"]


# --- overlays -------------------------------------------------------------------------------


def test_cpu_overlay_runs_float32_on_cpu_with_tcp_kv(cpu):
    for name in WORKERS:
        env = pod_env(cpu, name)
        assert (env["PDSERVE_DEVICE"], env["PDSERVE_DTYPE"], env["PDSERVE_KV_TRANSPORT"]) == (
            "cpu",
            "float32",
            "tcp",
        )
        limits = _containers(get_object(cpu, "Deployment", name))[0]["resources"]["limits"]
        assert "nvidia.com/gpu" not in limits


def test_gpu_overlay_requests_one_gpu_per_worker_in_bfloat16(gpu):
    for name in WORKERS:
        c = _containers(get_object(gpu, "Deployment", name))[0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "1"
        env = pod_env(gpu, name)
        assert (env["PDSERVE_DEVICE"], env["PDSERVE_DTYPE"]) == ("cuda", "bfloat16")
    router = _containers(get_object(gpu, "Deployment", "pdserve-router"))[0]
    assert "nvidia.com/gpu" not in router["resources"]["limits"]


def test_gpu_overlay_offers_between_pods_only_what_works_between_pods(gpu):
    # Each pod has its own GPU, IPC namespace and /dev/shm: CUDA IPC and shm cannot cross pods.
    assert pod_env(gpu, "pdserve-router")["PDSERVE_KV_TRANSPORT"] == "auto"
    for name in WORKERS:
        env = pod_env(gpu, name)
        assert env["PDSERVE_KV_TRANSPORT"].split(",") == ["tcp"]
        host_id = next(
            e
            for e in _containers(get_object(gpu, "Deployment", name))[0]["env"]
            if e["name"] == "PDSERVE_HOST_ID"
        )
        assert host_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"


def test_gpu_workers_keep_tritons_cache_on_a_mounted_volume(gpu):
    # The root filesystem is read-only; the warm-up compiles every kernel variant into this folder.
    for name in WORKERS:
        path = pod_env(gpu, name)["PDSERVE_TRITON_CACHE"]
        pod = _pod(get_object(gpu, "Deployment", name))
        mount = next(m for m in _containers(get_object(gpu, "Deployment", name))[0]["volumeMounts"]
                     if m["mountPath"] == path)
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert "emptyDir" in volume and not mount.get("readOnly", False)


def test_router_pairs_every_prefill_and_decode_pod_over_tcp_even_on_one_node(overlay):
    # The translated pods stand for pods of one node (k8s_render.LOCAL_NODE_NAME); still, no
    # pair may get a transport that needs one IPC namespace, /dev/shm or GPU set.
    _, objs = overlay
    specs = local_process_specs(objs, pdserve="pdserve")
    policy = next(s for s in specs if s.component == "router").env["PDSERVE_KV_TRANSPORT"]

    def register(spec) -> Register:
        return Register(
            worker_id=spec.name,
            role=spec.component,
            kv_address=f"tcp://127.0.0.1:{spec.ports['kv']}",
            fingerprint=FINGERPRINT,
            num_blocks=100,
            max_model_len=4096,
            kv_transports=tuple(spec.env["PDSERVE_KV_TRANSPORT"].split(",")),
            host_id=spec.env["PDSERVE_HOST_ID"],
        )

    prefills = [s for s in specs if s.component == "prefill"]
    decodes = [s for s in specs if s.component == "decode"]
    for p, d in itertools.product(prefills, decodes):
        registry = Registry(hash_blocks, policy, True)
        for spec in (p, d):
            assert registry.register(register(spec), 0.0) == (None, None)
        route = registry.pick("r", list(range(4 * FINGERPRINT.block_size)), 8)
        assert (route.first, route.decode, route.kv_transport) == (p.name, d.name, "tcp")


# --- secrets --------------------------------------------------------------------------------


def _secret_refs(objs: list[dict[str, Any]]) -> dict[tuple[str, str], bool]:
    """(Secret name, key) -> optional, for every secretKeyRef of every container."""
    refs: dict[tuple[str, str], bool] = {}
    for w in _workloads(objs):
        for c in _containers(w):
            assert not [s for s in c.get("envFrom") or [] if "secretRef" in s]
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    refs[(ref["name"], ref["key"])] = bool(ref.get("optional"))
    return refs


def test_applying_the_manifests_never_overwrites_a_secret(overlay):
    _, objs = overlay
    assert objects_of_kind(objs, "Secret") == []
    assert _secret_refs(objs)[("pdserve-internal", "secret")] is False  # required, not shipped


def test_no_pod_starts_without_the_deployment_secret(cpu):
    with pytest.raises(KeyError, match="pdserve-internal"):
        local_process_specs(cpu, pdserve="pdserve", operator_secrets={})
    for name in WORKLOADS:
        with pytest.raises(KeyError, match="pdserve-internal"):
            pod_env(cpu, name, operator_secrets={})


def test_kubernetes_md_creates_every_secret_the_pods_read(overlay):
    _, objs = overlay
    text = (REPO / "docs" / "kubernetes.md").read_text()
    created = set(re.findall(r"kubectl -n pdserve create secret generic (\S+) --from-literal=([\w.-]+)=", text))
    assert set(_secret_refs(objs)) <= created
    assert "kubectl apply -k" in text and "internal-secret.yaml" not in text


def _router_config_in(env: dict[str, str], monkeypatch: pytest.MonkeyPatch):
    """The router's configuration as `pdserve router` builds it in a pod with this env."""
    for name in list(envs.registered()):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    p = argparse.ArgumentParser()
    add_router_cli_arguments(p)
    return router_config(p.parse_args([]))


def test_router_refuses_to_start_without_the_api_key_secret(overlay, monkeypatch):
    _, objs = overlay
    env = pod_env(objs, "pdserve-router")
    assert "PDSERVE_API_KEY" not in env
    with pytest.raises(ConfigError, match="no API key"):
        _router_config_in(env, monkeypatch)


def test_router_starts_with_the_api_key_secret_or_the_explicit_opt_out(overlay, monkeypatch):
    _, objs = overlay
    with_key = pod_env(objs, "pdserve-router", operator_secrets={**OPERATOR_SECRETS, "pdserve-api-key": {"api-key": "k"}})
    assert _router_config_in(with_key, monkeypatch).api_key == "k"
    opted_out = {**pod_env(objs, "pdserve-router"), "PDSERVE_ALLOW_UNAUTHENTICATED": "true"}
    config = _router_config_in(opted_out, monkeypatch)
    assert (config.api_key, config.allow_unauthenticated) == (None, True)


# --- images ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_image_runs_pdserve_as_the_uid_the_pods_require(dockerfile):
    text = (REPO / "docker" / dockerfile).read_text()
    assert re.findall(r"^USER\s+(\S+)", text, re.M)[-1].split(":")[0] == str(UID)
    assert re.findall(r"^ENTRYPOINT\s+(.+)$", text, re.M)[-1].strip() == '["pdserve"]'


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_image_copies_every_package_of_the_project(dockerfile):
    text = (REPO / "docker" / dockerfile).read_text()
    packages = {"pdserve", *(folder.name for folder in package_folders().values())}
    copied = {
        tok.rstrip("/")
        for line in re.findall(r"^COPY\s+(.+)$", text, re.M)
        for tok in line.split()[:-1]
    }
    assert packages <= copied


# --- translation to local processes (what tests/k8s/test_processes.py runs) -------------------


def test_cpu_overlay_translates_to_two_routers_two_prefill_two_decode(cpu):
    specs = local_process_specs(cpu, pdserve="/venv/bin/pdserve")
    assert sorted(s.component for s in specs) == [
        "decode",
        "decode",
        "prefill",
        "prefill",
        "router",
        "router",
    ]
    assert all(s.argv == ("/venv/bin/pdserve", s.component) for s in specs)


def test_translated_processes_use_loopback_and_distinct_ports(cpu):
    specs = local_process_specs(cpu, pdserve="pdserve")
    ports = [p for s in specs for p in s.ports.values()]
    assert len(ports) == len(set(ports))
    for s in specs:
        assert s.env["PDSERVE_HOST"] == "127.0.0.1"
        assert not [
            v for v in s.env.values() if "pdserve-router" in v or "0.0.0.0" in v or ".svc" in v
        ]


def test_translated_workers_reach_every_routers_control_port(cpu):
    # The headless Service's name resolves to every router pod: locally, every router's address.
    specs = local_process_specs(cpu, pdserve="pdserve")
    routers = [s for s in specs if s.component == "router"]
    for router in routers:
        assert router.env["PDSERVE_CONTROL_ADDRESS"] == f"tcp://127.0.0.1:{router.ports['control']}"
    for s in specs:
        if s.component != "router":
            assert s.env["PDSERVE_ROUTER_ADDRESS"] == ",".join(r.env["PDSERVE_CONTROL_ADDRESS"] for r in routers)
            assert s.env["PDSERVE_KV_PORT"] == str(s.ports["kv"])
            assert s.probes["readinessProbe"] == f"http://127.0.0.1:{s.ports['health']}/ready"


def test_translation_leaves_out_an_optional_secret_that_does_not_exist(cpu):
    router = next(s for s in local_process_specs(cpu, pdserve="pdserve") if s.component == "router")
    assert "PDSERVE_API_KEY" not in router.env
