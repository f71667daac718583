"""charts/tensile rendered by the real Helm engine (helm-python-sdk), checked against Kubernetes' own
schemas (kubernetes-validate, strict), against the code it deploys (the RBAC call lists, the CLI flags,
the Kopf peering name and webhook path) and against its values.schema.json.

kubernetes-validate has no schema for custom kinds (ServiceMonitor, cert-manager's Issuer and
Certificate, Kopf's ClusterKopfPeering): those, and only those, are skipped there and checked here.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil
import ssl
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helm_python import Chart, HelmValuesError, lint

from tensile.local.jobs import strict_schema

from tests.support.chart_render import CHART_DIR, NAMESPACE, find, objects, one, render

ROOT = CHART_DIR.parents[1]
KUBE_VERSIONS = ("1.30.0", "1.34.0")
MONITORING = "monitoring.coreos.com/v1"
NO_SCHEMA_KINDS = {"ServiceMonitor", "Issuer", "Certificate", "ClusterKopfPeering"}

# name -> (values, API versions the cluster serves)
CASES: dict[str, tuple[dict, tuple[str, ...]]] = {
    "defaults": ({}, ()),
    "monitoring-with-api": ({}, (MONITORING,)),
    "monitoring-off-with-api": ({"monitoring": {"serviceMonitor": {"enabled": False}}}, (MONITORING,)),
    "cert-manager": ({"webhook": {"certManager": {"enabled": True}}}, ()),
    "cert-manager-issuer": ({"webhook": {"certManager": {"enabled": True, "issuerRef": {
        "name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}}}}, ()),
    "no-webhook": ({"webhook": {"enabled": False}}, ()),
    "pod-network": ({"agent": {"hostNetwork": False, "runtimeClassName": "nvidia"}}, (MONITORING,)),
    "custom-placement": ({
        "operator": {"resources": {"requests": {"cpu": "2", "memory": "3Gi"}, "limits": {"memory": "6Gi"}},
                     "nodeSelector": {"pool": "system"}, "profiles": {"existingClaim": "tensile-profiles"},
                     "metricsPort": 9090, "healthPort": 9091},
        "agent": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": 1, "memory": "1Gi"}},
                  # Helm merges maps with the defaults: null removes the default GPU label.
                  "nodeSelector": {"gpu": "a100", "nvidia.com/gpu.present": None}, "tolerations": [],
                  "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                      {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100", "h100"]}]}]}}}},
        "imagePullSecrets": [{"name": "regcred"}]}, ()),
    "simulated-gpus": ({"agent": {"simulateGpus": ["a6000:48GiB", "h100:80GB"], "contextBytes": "600MiB",
                                  "nodeSelector": {"nvidia.com/gpu.present": None}, "headroom": 0.1}}, ()),
    "no-agent": ({"agent": {"enabled": False}}, (MONITORING,)),
    "own-token-secret": ({"tokenKey": {"existingSecret": "my-token"}, "image": {"tag": "dev"}}, ()),
    "legacy-gpu-access": ({"gpuAccess": {"mode": "legacy"}}, ()),
    "own-device-class": ({"gpuAccess": {"deviceClass": "gpus.example.com", "attributeDomain": "example.com"}}, ()),
}


@pytest.fixture(scope="module")
def chart() -> Chart:
    with Chart.load(CHART_DIR) as loaded:
        yield loaded


def case(chart: Chart, name: str, kube_version: str = "v1.34.0") -> list[dict]:
    values, apis = CASES[name]
    return objects(render(chart, values, kube_version=kube_version, api_versions=apis))


def container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


# ---- Kubernetes' schemas ------------------------------------------------------------------------


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_objects_are_valid_kubernetes(chart: Chart, name: str, kube_version: str) -> None:
    objs = case(chart, name, "v" + kube_version)
    assert objs
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            assert obj["kind"] in NO_SCHEMA_KINDS, f"no schema for {obj['kind']}: a typo in apiVersion/kind?"
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} invalid for {kube_version}: {exc.message}")


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_crds_are_valid_and_identical_to_the_repository(chart: Chart, kube_version: str) -> None:
    shipped = {Path(c["filename"]).name: c["data"] for c in chart.crds}
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        assert shipped.pop(path.name, None) == path.read_text(), f"charts/tensile/crds/{path.name} differs from crds/"
    assert set(shipped) == {"clusterkopfpeerings.kopf.dev.yaml"}, "only Kopf's peering CRD is the chart's own"
    for c in chart.crds:
        kubernetes_validate.validate(yaml.safe_load(c["data"]), kube_version, strict=True)


@pytest.mark.parametrize("name", ["defaults", "cert-manager", "pod-network", "custom-placement"])
def test_lint_strict_is_clean(name: str) -> None:
    for kube_version in KUBE_VERSIONS:
        report = lint(CHART_DIR, CASES[name][0], strict=True, namespace=NAMESPACE, kube_version="v" + kube_version)
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert not problems, problems


# ---- the examples against the CRD ---------------------------------------------------------------


@pytest.fixture(scope="module")
def trainingjob_validator() -> jsonschema.Draft4Validator:
    crd = yaml.safe_load((ROOT / "crds" / "trainingjobs.tensile.dev.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    # OpenAPI v3.0 schemas use draft 4's boolean exclusiveMinimum.
    return jsonschema.Draft4Validator(strict_schema(version["schema"]["openAPIV3Schema"]))


EXAMPLES = sorted((ROOT / "examples").glob("trainingjob-*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_match_the_crd(path: Path, trainingjob_validator: jsonschema.Draft4Validator) -> None:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert (doc["apiVersion"], doc["kind"]) == ("tensile.dev/v1alpha1", "TrainingJob")
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in trainingjob_validator.iter_errors(doc)]
    assert not errors, errors


def test_the_crd_check_refuses_bad_jobs(trainingjob_validator: jsonschema.Draft4Validator) -> None:
    assert EXAMPLES
    doc = yaml.safe_load(EXAMPLES[0].read_text())
    typo, enum, count = copy.deepcopy(doc), copy.deepcopy(doc), copy.deepcopy(doc)
    typo["spec"]["memoryBudgt"] = "1Gi"
    enum["spec"]["workload"]["optimizer"] = "lion"
    count["spec"]["scheduling"] = {"maxSwapRate": 0}
    for bad, field in ((typo, "memoryBudgt"), (enum, "lion"), (count, "0")):
        messages = [e.message for e in trainingjob_validator.iter_errors(bad)]
        assert any(field in m for m in messages), messages


# ---- RBAC is the code's call lists --------------------------------------------------------------


def granted(role: dict) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_rbac_is_exactly_the_call_lists(chart: Chart) -> None:
    from tensile_agent.cluster import RBAC
    from tensile_operator.rbac import RULES

    objs = case(chart, "defaults")
    operator_role, agent_role = one(objs, "ClusterRole", "operator"), one(objs, "ClusterRole", "agent")
    assert granted(operator_role) == {(g, r, v) for g, r, verbs, _ in RULES for v in verbs}
    assert granted(agent_role) == {(g, r, v) for g, r, verbs in RBAC for v in verbs}
    assert len(find(objs, "ClusterRole")) == 2 and not find(objs, "Role")
    # legacy mode makes no resource.k8s.io call, and is granted none
    legacy = one(case(chart, "legacy-gpu-access"), "ClusterRole", "operator")
    assert granted(legacy) == {(g, r, v) for g, r, verbs, _ in RULES for v in verbs if g != "resource.k8s.io"}
    for component in ("operator", "agent"):
        binding = one(objs, "ClusterRoleBinding", component)
        pods = one(objs, "Deployment" if component == "operator" else "DaemonSet", component)
        assert binding["roleRef"]["name"] == one(objs, "ClusterRole", component)["metadata"]["name"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "namespace": NAMESPACE,
                                        "name": pods["spec"]["template"]["spec"]["serviceAccountName"]}]
        assert one(objs, "ServiceAccount", component)["metadata"]["name"] == binding["subjects"][0]["name"]


# ---- operator ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "mode", "device_class"), [("defaults", "dra", "gpu.nvidia.com"),
                                                             ("legacy-gpu-access", "legacy", "gpu.nvidia.com"),
                                                             ("own-device-class", "dra", "gpus.example.com")])
def test_the_gpu_access_mode_reaches_the_operator(chart: Chart, name: str, mode: str, device_class: str) -> None:
    from tensile_operator.claims import GpuAccess

    env = env_of(container(one(case(chart, name), "Deployment", "operator")))
    access = GpuAccess.from_env({k: v["value"] for k, v in env.items() if "value" in v})
    assert (access.mode, access.device_class) == (mode, device_class)
    notes = render(chart, CASES[name][0])["tensile/templates/NOTES.txt"]
    assert ("with consumable capacity" in notes) == (mode == "dra")


@pytest.mark.parametrize("values", ["defaults", "custom-placement"])
def test_operator_runs_the_cli_it_is_given(chart: Chart, monkeypatch: pytest.MonkeyPatch, values: str) -> None:
    from tensile.cli import build_parser
    from tensile_operator.handlers import PEERING
    from tensile_operator.metrics import metrics_port

    objs = case(chart, values)
    deployment = one(objs, "Deployment", "operator")
    c = container(deployment)
    env = env_of(c)
    for name, entry in env.items():  # the parser reads its defaults from the environment
        if "value" in entry:
            monkeypatch.setenv(name, entry["value"])
    args = build_parser().parse_args(c["args"])
    assert args.command == "operator" and not args.standalone
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    assert one(objs, "ClusterKopfPeering")["metadata"]["name"] == PEERING
    liveness = re.fullmatch(r"http://0\.0\.0\.0:(\d+)(/\S+)", args.liveness)
    assert liveness, args.liveness
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert (ports[get["port"]], get["path"]) == (int(liveness[1]), liveness[2])
    assert env["TENSILE_IMAGE"]["value"] == c["image"], "training pods' init container uses the same image"
    assert ports["metrics"] == metrics_port(args.metrics_port), "the operator serves metrics where the Service points"
    secret = next(o for o in objs if o["kind"] == "Secret" and "token-key" in o["data"])
    ref = env["TENSILE_TOKEN_KEY"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (secret["metadata"]["name"], "token-key")
    assert len(base64.b64decode(secret["data"]["token-key"])) >= 32
    assert c["resources"] == CASES[values][0].get("operator", {}).get("resources", chart.values["operator"]["resources"])


def test_custom_resources_and_placement_reach_the_pods(chart: Chart) -> None:
    values = CASES["custom-placement"][0]
    objs = case(chart, "custom-placement")
    operator, agent = one(objs, "Deployment", "operator"), one(objs, "DaemonSet", "agent")
    assert container(operator)["resources"] == values["operator"]["resources"]
    assert operator["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "system"}
    claim = {v["name"]: v for v in operator["spec"]["template"]["spec"]["volumes"]}["profiles"]
    assert claim["persistentVolumeClaim"]["claimName"] == "tensile-profiles"
    pod = agent["spec"]["template"]["spec"]
    assert container(agent)["resources"] == values["agent"]["resources"]
    assert pod["nodeSelector"] == {"gpu": "a100"} and pod["affinity"] == values["agent"]["affinity"]
    assert "tolerations" not in pod
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_own_token_secret_and_image_tag(chart: Chart) -> None:
    objs = case(chart, "own-token-secret")
    assert not [o for o in objs if o["kind"] == "Secret" and "token-key" in o.get("data", {})]
    c = container(one(objs, "Deployment", "operator"))
    assert env_of(c)["TENSILE_TOKEN_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "my-token"
    assert c["image"] == "ghcr.io/tensile/tensile:dev" == env_of(c)["TENSILE_IMAGE"]["value"]


# ---- agent --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["defaults", "pod-network", "simulated-gpus"])
def test_agent_daemonset(chart: Chart, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tensile_agent.server import add_arguments, config_from_args
    import argparse

    values = chart.merge_values(CASES[name][0])["agent"]
    daemonset = one(case(chart, name), "DaemonSet", "agent")
    pod = daemonset["spec"]["template"]["spec"]
    c = container(daemonset)
    env = env_of(c)
    assert c["args"][0] == "agent"
    for var in ("NODE_NAME", "POD_IP", "TENSILE_AGENT_URL", "TENSILE_AGENT_PORT", "TENSILE_AGENT_HOST"):
        monkeypatch.delenv(var, raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(c["args"][1:]))
    # the node's address (the pod's, on the host network), which Kubernetes puts in place of $(POD_IP): no other interface
    assert (config.host, config.port, config.simulate) == ("$(POD_IP)", values["port"], values["simulateGpus"])
    assert config.headroom == values["headroom"] and config.auth == "kubernetes"
    assert config.operator_accounts == (f"system:serviceaccount:{NAMESPACE}:"
                                        f"{one(case(chart, name), 'Deployment', 'operator')['spec']['template']['spec']['serviceAccountName']}",)
    assert (config.registrations.per_gpu, config.registrations.per_namespace) == (values["maxJobsPerGpu"],
                                                                                  values["maxJobsPerNamespace"])
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert pod.get("hostNetwork", False) is values["hostNetwork"]
    (port,) = c["ports"]
    assert port["containerPort"] == values["port"] and port.get("hostPort") == (values["port"] if values["hostNetwork"] else None)
    if values["hostNetwork"]:
        assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod.get("runtimeClassName", "") == values["runtimeClassName"]
    assert pod.get("nodeSelector", {}) == values["nodeSelector"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()


def test_agent_can_be_left_out(chart: Chart) -> None:
    objs = case(chart, "no-agent")
    assert not [o for o in objs if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "agent"]
    assert [o["metadata"]["name"] for o in find(objs, "ServiceMonitor")] == ["tensile-operator"]


# ---- services and monitoring --------------------------------------------------------------------


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("name", ["defaults", "pod-network", "no-webhook"])
def test_services_reach_named_container_ports(chart: Chart, name: str) -> None:
    objs = case(chart, name)
    workloads = find(objs, "Deployment") + find(objs, "DaemonSet")
    for service in find(objs, "Service"):
        (target,) = [w for w in workloads if selects(service["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        names = {p["name"] for p in container(target)["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names, service["metadata"]["name"]


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("served", [True, False])
def test_servicemonitors_only_with_the_api_and_enabled(chart: Chart, enabled: bool, served: bool) -> None:
    values = {"monitoring": {"serviceMonitor": {"enabled": enabled, "labels": {"release": "kps"}, "interval": "15s"}}}
    rendered = render(chart, values, api_versions=(MONITORING,) if served else ())
    objs = objects(rendered)
    monitors = find(objs, "ServiceMonitor")
    if not (enabled and served):
        assert not monitors
        assert ("does not serve monitoring.coreos.com/v1" in rendered["tensile/templates/NOTES.txt"]) == enabled
        return
    assert {m["metadata"]["labels"]["app.kubernetes.io/component"] for m in monitors} == {"operator", "agent"}
    for monitor in monitors:
        assert monitor["metadata"]["labels"]["release"] == "kps"
        (service,) = [s for s in find(objs, "Service") if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
        assert (endpoint["path"], endpoint["honorLabels"], endpoint["interval"]) == ("/metrics", True, "15s")
        assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]


# ---- webhook and its certificates ---------------------------------------------------------------


def tls_handshake(ca_pem: str, cert_pem: str, key_pem: str, hostname: str, tmp_path: Path) -> None:
    """A TLS handshake in memory: a server with the certificate and a client that trusts only the CA
    and checks the host name, as the API server does when it calls the webhook."""
    (tmp_path / "tls.crt").write_text(cert_pem)
    (tmp_path / "tls.key").write_text(key_pem)
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    client_context = ssl.create_default_context(cadata=ca_pem)
    bios = [ssl.MemoryBIO() for _ in range(4)]
    client = client_context.wrap_bio(bios[0], bios[1], server_hostname=hostname)
    server = server_context.wrap_bio(bios[2], bios[3], server_side=True)
    done = {"client": False, "server": False}
    for _ in range(20):
        for side, end, outgoing, peer_incoming in (("client", client, bios[1], bios[2]), ("server", server, bios[3], bios[0])):
            if not done[side]:
                try:
                    end.do_handshake()
                    done[side] = True
                except ssl.SSLWantReadError:
                    pass
            peer_incoming.write(outgoing.read())
        if all(done.values()):
            return
    raise AssertionError("TLS handshake did not finish")


def webhook_parts(objs: list[dict]) -> tuple[dict, dict, dict]:
    config = one(objs, "ValidatingWebhookConfiguration")
    hook, _, _ = config["webhooks"]  # the TrainingJobs', the TensileNodes' and the agents' TrainingJob writes
    service = next(s for s in find(objs, "Service") if s["metadata"]["name"] == hook["clientConfig"]["service"]["name"])
    return config, hook, service


def test_webhook_routes_to_kopfs_handler(chart: Chart) -> None:
    import kopf

    from tensile_operator.app import OperatorApp
    from tensile_operator.handlers import build_registry

    objs = case(chart, "defaults")
    _, hook, service = webhook_parts(objs)
    registry = build_registry(OperatorApp(), kopf.WebhookServer(port=1))
    ids = [h.id for h in registry._webhooks.get_all_handlers()]
    assert hook["clientConfig"]["service"]["path"] in {"/" + i for i in ids}
    assert hook["rules"][0]["resources"] == ["trainingjobs"] and hook["rules"][0]["apiGroups"] == ["tensile.dev"]
    c = container(one(objs, "Deployment", "operator"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    (port,) = service["spec"]["ports"]
    assert ports[port["targetPort"]] == int(env_of(c)["TENSILE_WEBHOOK_PORT"]["value"])
    assert hook["clientConfig"]["service"]["port"] == port["port"]


def test_generated_certificates_serve_the_webhook(chart: Chart, tmp_path: Path) -> None:
    objs = case(chart, "defaults")
    config, hook, service = webhook_parts(objs)
    operator = one(objs, "Deployment", "operator")
    env = env_of(container(operator))
    volumes = {v["name"]: v for v in operator["spec"]["template"]["spec"]["volumes"]}
    mount = next(m for m in container(operator)["volumeMounts"] if m["mountPath"] == str(Path(env["TENSILE_WEBHOOK_CERT"]["value"]).parent))
    secret_name = volumes[mount["name"]]["secret"]["secretName"]
    secret = next(o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == secret_name)
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert {Path(env[k]["value"]).name for k in ("TENSILE_WEBHOOK_CERT", "TENSILE_WEBHOOK_KEY")} <= set(data)
    assert base64.b64decode(hook["clientConfig"]["caBundle"]).decode() == data["ca.crt"]
    assert "cert-manager.io/inject-ca-from" not in config["metadata"].get("annotations", {})
    host = f"{service['metadata']['name']}.{NAMESPACE}.svc"
    tls_handshake(data["ca.crt"], data["tls.crt"], data["tls.key"], host, tmp_path)
    with pytest.raises(ssl.SSLCertVerificationError):
        tls_handshake(data["ca.crt"], data["tls.crt"], data["tls.key"], "elsewhere.example", tmp_path)


@pytest.mark.parametrize("name", ["cert-manager", "cert-manager-issuer"])
def test_cert_manager_certificates(chart: Chart, name: str) -> None:
    objs = case(chart, name)
    config, hook, service = webhook_parts(objs)
    certificate = one(objs, "Certificate")
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/{certificate['metadata']['name']}"
    assert "caBundle" not in hook["clientConfig"]
    assert f"{service['metadata']['name']}.{NAMESPACE}.svc" in certificate["spec"]["dnsNames"]
    assert not [o for o in objs if o["kind"] == "Secret" and o.get("type") == "kubernetes.io/tls"]
    volumes = one(objs, "Deployment", "operator")["spec"]["template"]["spec"]["volumes"]
    assert certificate["spec"]["secretName"] in {v.get("secret", {}).get("secretName") for v in volumes}
    issuers = find(objs, "Issuer")
    if name == "cert-manager":
        assert [i["spec"] for i in issuers] == [{"selfSigned": {}}]
        assert certificate["spec"]["issuerRef"] == {"name": issuers[0]["metadata"]["name"], "kind": "Issuer"}
    else:
        assert not issuers and certificate["spec"]["issuerRef"] == CASES[name][0]["webhook"]["certManager"]["issuerRef"]


def test_webhook_can_be_turned_off(chart: Chart) -> None:
    objs = case(chart, "no-webhook")
    assert not find(objs, "ValidatingWebhookConfiguration")
    assert "TENSILE_WEBHOOK_PORT" not in env_of(container(one(objs, "Deployment", "operator")))


# ---- dashboards ---------------------------------------------------------------------------------


def dashboard_maps(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["labels"].get("grafana_dashboard") == "1"]


def test_one_configmap_per_shipped_dashboard(chart: Chart) -> None:
    files = sorted(p.name for p in (CHART_DIR / "dashboards").glob("*.json"))
    maps = dashboard_maps(case(chart, "defaults"))
    assert sorted(k for m in maps for k in m["data"]) == files
    assert len({m["metadata"]["name"] for m in maps}) == len(maps)


@pytest.mark.parametrize("folder", ["two", "empty", "absent"])
def test_dashboards_folder_contents(tmp_path: Path, folder: str) -> None:
    copied = tmp_path / "tensile"
    shutil.copytree(CHART_DIR, copied, ignore=shutil.ignore_patterns("dashboards"))
    boards = {"GPU_memory.json": {"title": "GPU memory", "panels": []}, "jobs.json": {"title": "Jobs", "panels": []}}
    if folder != "absent":
        (copied / "dashboards").mkdir()
    if folder == "two":
        for file, board in boards.items():
            (copied / "dashboards" / file).write_text(json.dumps(board, indent=2))
    with Chart.load(copied) as local:
        values = {"dashboards": {"namespace": "monitoring", "labels": {"team": "ml"}, "annotations": {"grafana_folder": "Tensile"}}}
        maps = dashboard_maps(objects(render(local, values)))
    if folder != "two":
        assert not maps
        return
    assert {k: json.loads(v) for m in maps for k, v in m["data"].items()} == boards
    for m in maps:
        assert m["metadata"]["namespace"] == "monitoring" and m["metadata"]["labels"]["team"] == "ml"
        assert m["metadata"]["annotations"] == {"grafana_folder": "Tensile"}
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", m["metadata"]["name"]), m["metadata"]["name"]


# ---- values.schema.json -------------------------------------------------------------------------


BAD_VALUES = [
    ({"operator": {"replicas": -1}}, "/operator/replicas"),
    ({"operator": {"replicas": 2}}, "/operator/replicas"),
    ({"operator": {"replicas": "one"}}, "/operator/replicas"),
    ({"agent": {"port": 70000}}, "/agent/port"),
    ({"agent": {"hostNetwork": "yes"}}, "/agent/hostNetwork"),
    ({"agent": {"headroom": 1.5}}, "/agent/headroom"),
    ({"agent": {"simulateGpus": ["48GiB"]}}, "/agent/simulateGpus/0"),
    ({"agent": {"contextBytes": "lots"}}, "/agent/contextBytes"),
    ({"agent": {"nodeSelector": {"gpu": True}}}, "/agent/nodeSelector/gpu"),
    ({"agent": {"resources": {"limits": {"memory": "2 gigs"}}}}, "/agent/resources/limits/memory"),
    ({"webhook": {"failurePolicy": "Sometimes"}}, "/webhook/failurePolicy"),
    ({"webhook": {"certManager": {"issuerRef": {"kind": "Issuer"}}}}, "/webhook/certManager/issuerRef"),
    ({"monitoring": {"serviceMonitor": {"interval": "soon"}}}, "/monitoring/serviceMonitor/interval"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"agnet": {"port": 8470}}, "agnet"),
    ({"operator": {"replica": 1}}, "replica"),
]


@pytest.mark.parametrize("values,field", BAD_VALUES, ids=[f for _, f in BAD_VALUES])
def test_schema_rejects_bad_values_naming_the_field(chart: Chart, values: dict, field: str) -> None:
    with pytest.raises(HelmValuesError) as caught:
        render(chart, values)
    assert field in str(caught.value), str(caught.value)


def test_schema_accepts_every_case_and_is_valid_json_schema(chart: Chart) -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    for values, _ in CASES.values():
        chart.validate_schema(chart.merge_values(values))


def test_byte_amounts_the_schema_accepts_parse_in_the_agent() -> None:
    from tensile_agent.gpus import parse_bytes

    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    pattern = schema["properties"]["agent"]["properties"]["contextBytes"]["pattern"]
    for text in ("600MiB", "48GiB", "80GB", "16000000000", "1.5G", "512k", "100b", "5Gi", "512Mi", "2e9"):
        assert re.search(pattern, text), text
        assert parse_bytes(text) > 0


def test_notes_tell_the_next_step(chart: Chart) -> None:
    notes = render(chart)["tensile/templates/NOTES.txt"]
    applied = re.findall(r"kubectl apply -f (\S+)", notes)
    assert applied and all((ROOT / path).exists() for path in applied), applied
    assert "grafana_dashboard" in notes and "kubectl get trainingjobs" in notes
    assert "folder" not in notes  # it promised a folder "Tensile" that no default value sets
    foldered = render(chart, {"dashboards": {"annotations": {"grafana_folder": "Training"}}})["tensile/templates/NOTES.txt"]
    assert '(folder "Training", where your sidecar folders by annotation)' in foldered


# ---- who reaches the agent, and with what --------------------------------------------------------


def test_only_training_pods_and_the_operator_reach_the_agent(chart: Chart) -> None:
    from tensile_agent.auth import AUDIENCE
    from tensile_operator.pods import JOB_LABEL

    objs = case(chart, "defaults")
    (policy,) = find(objs, "NetworkPolicy")
    daemonset, operator = one(objs, "DaemonSet", "agent"), one(objs, "Deployment", "operator")
    assert policy["spec"]["podSelector"]["matchLabels"] == daemonset["spec"]["selector"]["matchLabels"]
    (rule,) = policy["spec"]["ingress"]
    jobs, the_operator = rule["from"]
    assert jobs == {"namespaceSelector": {}, "podSelector": {"matchExpressions": [{"key": JOB_LABEL, "operator": "Exists"}]}}
    assert the_operator == {"podSelector": {"matchLabels": operator["spec"]["selector"]["matchLabels"]}}
    # the operator presents its service account's token for the agents' audience, from a projected volume
    pod = operator["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "projected" in v]
    (source,) = volume["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == AUDIENCE
    (mount,) = [m for m in container(operator)["volumeMounts"] if m["name"] == volume["name"]]
    path = env_of(container(operator))["TENSILE_OPERATOR_TOKEN_FILE"]["value"]
    assert path == f"{mount['mountPath']}/{source['serviceAccountToken']['path']}"


def test_the_tensilenodes_webhook_guards_the_agents_writes(chart: Chart) -> None:
    """Every write of a TensileNode or its status goes to the handler that lets an agent write only its own node's; the
    operator knows the agents' user."""
    import kopf

    from tensile_operator.app import OperatorApp
    from tensile_operator.handlers import build_registry

    objs = case(chart, "defaults")
    _, nodes, _ = one(objs, "ValidatingWebhookConfiguration")["webhooks"]
    registry = build_registry(OperatorApp(), kopf.WebhookServer(port=1))
    assert nodes["clientConfig"]["service"]["path"] in {"/" + h.id for h in registry._webhooks.get_all_handlers()}
    (rule,) = nodes["rules"]
    assert (rule["resources"], rule["operations"], rule["scope"]) == (["tensilenodes", "tensilenodes/status"],
                                                                      ["CREATE", "UPDATE"], "Cluster")
    agent = one(objs, "DaemonSet", "agent")["spec"]["template"]["spec"]["serviceAccountName"]
    accounts = env_of(container(one(objs, "Deployment", "operator")))["TENSILE_AGENT_ACCOUNTS"]["value"]
    assert accounts == f"system:serviceaccount:{NAMESPACE}:{agent}"


def test_the_trainingjobs_webhook_guards_the_agents_writes(chart: Chart) -> None:
    """Every write of a TrainingJob or its status goes to the handler that lets an agent write only the observed figures
    of a job on its own node (the operator books capacity from the rest of the status)."""
    import kopf

    from tensile_operator.app import OperatorApp
    from tensile_operator.handlers import build_registry

    objs = case(chart, "defaults")
    _, _, writers = one(objs, "ValidatingWebhookConfiguration")["webhooks"]
    registry = build_registry(OperatorApp(), kopf.WebhookServer(port=1))
    assert writers["clientConfig"]["service"]["path"] in {"/" + h.id for h in registry._webhooks.get_all_handlers()}
    (rule,) = writers["rules"]
    assert (rule["resources"], rule["operations"], rule["scope"]) == (["trainingjobs", "trainingjobs/status"],
                                                                      ["CREATE", "UPDATE"], "Namespaced")
