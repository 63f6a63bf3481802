"""The Helm chart in ``helm/tandem``, rendered and linted by real Helm, no cluster needed.

Helm runs in process through ``helm-python-sdk`` (ctypes over Helm's Go SDK: ``Chart.render``,
``helm_python.lint``). Every rendered object is validated against the Kubernetes OpenAPI schemas
shipped by ``kubernetes-validate`` (strict: unknown fields fail), except the ServiceMonitor: it
is a Prometheus Operator CRD with no schema there, so only its wiring is checked here. The
engine arguments and gateway environment are also parsed by the services' own argument parsers,
so a flag the chart passes that a service does not know fails here.
"""

from __future__ import annotations

import base64
import functools
import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml


def _require_module(name: str, why: str) -> ModuleType:
    """Import ``name``; skip without it, or fail under TANDEM_REQUIRE_TOOLS=1 (as CI runs)."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # ImportError, or helm_python's HelmLibraryError (no native library)
        message = f"{name} is not usable ({e}): {why}"
        if os.environ.get("TANDEM_REQUIRE_TOOLS") == "1":
            pytest.fail(message + " (TANDEM_REQUIRE_TOOLS=1)", pytrace=False)
        pytest.skip(message, allow_module_level=True)


helm = _require_module("helm_python", "pip install helm-python-sdk (Helm's Go SDK)")
kubernetes_validate = _require_module("kubernetes_validate", "pip install kubernetes-validate")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tandem"
VALUES_DIR = Path(__file__).parent / "helm_values"
RELEASE = "prod"
NAMESPACE = "llm"
K8S_VERSION = "1.34.0"  # schemas checked against; the chart needs >= 1.27 (gRPC probes)
# Custom resources kubernetes-validate has no schema for; checked by hand below.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
SCENARIOS = ["default", "gpu-pool", "mtls", "scale-out", "hostpath-cpu"]

Manifest = dict[str, Any]


@functools.cache
def values_of(scenario: str) -> dict[str, Any]:
    """The user values of a scenario, parsed by Helm as ``-f FILE`` would be."""
    if scenario == "default":
        return {}
    return helm.values_from_yaml((VALUES_DIR / f"{scenario}.yaml").read_text())


@functools.cache
def merged_values(scenario: str) -> dict[str, Any]:
    with helm.Chart.load(CHART) as chart:
        return chart.merge_values(values_of(scenario))


def render(values: dict[str, Any]) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


@functools.cache
def rendered(scenario: str) -> tuple[Manifest, ...]:
    docs: list[Manifest] = []
    for path, text in sorted(render(values_of(scenario)).items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return tuple(docs)


def objects(scenario: str, kind: str) -> list[Manifest]:
    return [d for d in rendered(scenario) if d["kind"] == kind]


def one(scenario: str, kind: str, component: str | None = None) -> Manifest:
    found = [
        d
        for d in objects(scenario, kind)
        if component is None
        or d["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    assert len(found) == 1, f"{scenario}: expected one {kind} ({component}), got {len(found)}"
    return found[0]


def deployment(scenario: str, component: str) -> Manifest:
    return one(scenario, "Deployment", component)


def pod_labels(scenario: str, component: str) -> dict[str, str]:
    return deployment(scenario, component)["spec"]["template"]["metadata"]["labels"]


def container(scenario: str, component: str) -> Manifest:
    (c,) = deployment(scenario, component)["spec"]["template"]["spec"]["containers"]
    return c


def volumes(scenario: str, component: str) -> dict[str, Manifest]:
    spec = deployment(scenario, component)["spec"]["template"]["spec"]
    return {v["name"]: v for v in spec.get("volumes", [])}


def mounts(scenario: str, component: str) -> dict[str, Manifest]:
    return {m["name"]: m for m in container(scenario, component).get("volumeMounts", [])}


def env(scenario: str, component: str) -> dict[str, Manifest]:
    return {e["name"]: e for e in container(scenario, component).get("env", [])}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def engine_args(scenario: str) -> Any:
    """The engine's argv as ``python -m engine_svc`` parses it."""
    from engine_svc.__main__ import parse_args

    c = container(scenario, "engine")
    assert c["command"] == ["python", "-m", "engine_svc"]
    return parse_args(c["args"])


def headless_service(scenario: str) -> Manifest:
    return one(scenario, "Service", "engine")


# ---- Helm: lint, render, schema ---------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lint_is_clean(scenario: str) -> None:
    report = helm.lint(
        CHART, values_of(scenario), strict=True, namespace=NAMESPACE, kube_version="v" + K8S_VERSION
    )
    assert report["errors"] == []
    # severity 2 = warning, 3 = error; 1 (info) is only "icon is recommended".
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_manifest_matches_the_kubernetes_schema(scenario: str) -> None:
    docs = rendered(scenario)
    assert docs
    for doc in docs:
        assert doc["metadata"]["namespace"] == NAMESPACE
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert doc["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue  # no schema shipped for CRDs; test_service_monitor checks it
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_validation_catches_a_broken_manifest() -> None:
    """The validator itself must bite: a misspelt field in a real rendered object fails."""
    broken = yaml.safe_load(yaml.safe_dump(deployment("default", "engine")))
    broken["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


EXPECTED_KINDS = {
    "default": {"ServiceAccount", "Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget"},
    "gpu-pool": {"ServiceAccount", "Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget"},
    "mtls": {
        "ServiceAccount",
        "Deployment",
        "Service",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Secret",
        "ServiceMonitor",
    },
    "scale-out": {
        "ServiceAccount",
        "Deployment",
        "Service",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "PersistentVolumeClaim",
    },
    "hostpath-cpu": {"ServiceAccount", "Deployment", "Service", "PodDisruptionBudget"},
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rendered_kinds(scenario: str) -> None:
    assert {d["kind"] for d in rendered(scenario)} == EXPECTED_KINDS[scenario]
    names = [(d["kind"], d["metadata"]["name"]) for d in rendered(scenario)]
    assert len(names) == len(set(names)), "two objects of one kind share a name"


BAD_VALUES = {
    "unknown top-level key": {"engines": {"replicaCount": 2}},
    "misspelt engine key": {"engine": {"replicas": 2}},
    "misspelt gpu key": {"engine": {"gpu": {"cuont": 2}}},
    "unknown model source": {"engine": {"model": {"source": "s3"}}},
    "existingClaim without a claim": {"engine": {"model": {"source": "existingClaim"}}},
    "absolute model path": {"engine": {"model": {"source": "newClaim", "path": "/x"}}},
    "bad dtype": {"engine": {"dtype": "fp8"}},
    "gpu utilization above 1": {"engine": {"gpuMemoryUtilization": 1.5}},
    "bad kv cache size": {"engine": {"kvCacheMemory": "lots"}},
    "probe handler in timings": {"engine": {"readinessProbe": {"exec": {"command": ["true"]}}}},
    "bad service type": {"frontend": {"service": {"type": "Ingress"}}},
    "port out of range": {"frontend": {"port": 70000}},
    "tls without secrets": {"tls": {"enabled": True}},
    "misspelt tls key": {"tls": {"enabeld": True}},
    "autoscaling typo": {"frontend": {"autoscaling": {"maxReplica": 4}}},
    "no gateway worker": {"frontend": {"workers": 0}},
    "workers not a number": {"frontend": {"workers": "2"}},
    "unknown tool-call parser": {"frontend": {"toolCallParser": "qwen"}},
    "unknown reasoning parser": {"frontend": {"reasoningParser": "qwen"}},
    "auto tool choice without a parser": {"frontend": {"enableAutoToolChoice": True}},
}


@pytest.mark.parametrize("values", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_schema_rejects_bad_values(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render(values)
    report = helm.lint(CHART, values, namespace=NAMESPACE)
    assert report["errors"], f"lint accepted {values}"


def test_bad_values_file_fails_render_and_lint() -> None:
    values = helm.values_from_yaml((VALUES_DIR / "bad-typo.yaml").read_text())
    with pytest.raises(helm.HelmValuesError) as excinfo:
        render(values)
    assert "cuont" in str(excinfo.value)
    assert "/frontend/service/type" in str(excinfo.value)
    errors = "\n".join(helm.lint(CHART, values, strict=True)["errors"])
    assert "cuont" in errors


# ---- engine -----------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_engine_runs_with_flags_the_engine_accepts(scenario: str) -> None:
    values = merged_values(scenario)["engine"]
    args = engine_args(scenario)
    assert args.host == "0.0.0.0"
    assert args.port == values["port"]
    assert args.shutdown_timeout == values["shutdownTimeout"]
    assert args.dtype == values["dtype"]
    assert args.device == values["device"]
    ports = {p["name"]: p["containerPort"] for p in container(scenario, "engine")["ports"]}
    assert ports["grpc"] == args.port


def test_engine_flags_from_values() -> None:
    args = engine_args("gpu-pool")
    assert args.model == "/models/Qwen3-8B"
    assert args.served_model_name == "qwen3-8b"
    assert (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens) == (8192, 128, 4096)
    assert args.gpu_memory_utilization == pytest.approx(0.92)
    assert args.max_waiting == 2048
    assert (args.dtype, args.device) == ("bfloat16", "cuda")
    default = engine_args("default")
    assert default.model is None  # the embedded model: no volume, no --model
    assert "model" not in volumes("default", "engine")
    assert engine_args("mtls").kv_cache_memory == "20GiB"
    assert engine_args("gpu-pool").tensor_parallel_size == 2
    assert default.tensor_parallel_size == 1 and "--tensor-parallel-size" not in str(
        container("default", "engine")["args"]
    )


def test_tensor_parallel_size_raises_the_gpu_limit() -> None:
    values = values_of("default")
    values.setdefault("engine", {})["tensorParallelSize"] = 4
    engine = next(
        d for path, text in render(values).items() if path.endswith("engine-deployment.yaml")
        for d in yaml.safe_load_all(text) if d
    )  # fmt: skip
    (c,) = engine["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4  # gpu.count 1, 4 ranks
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "4"


@pytest.mark.parametrize(
    ("scenario", "gpus"),
    [("default", 1), ("gpu-pool", 2), ("mtls", 1), ("scale-out", 1), ("hostpath-cpu", 0)],
)
def test_engine_gpu_limit(scenario: str, gpus: int) -> None:
    resources = container(scenario, "engine")["resources"]
    if gpus:
        assert resources["limits"]["nvidia.com/gpu"] == gpus
        assert "nvidia.com/gpu" not in resources.get("requests", {})
    else:
        assert "nvidia.com/gpu" not in resources.get("limits", {})
    # The rest of the resources come through untouched.
    requested = merged_values(scenario)["engine"]["resources"]["requests"]
    assert resources["requests"]["cpu"] == requested["cpu"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_engine_grpc_probes(scenario: str) -> None:
    c = container(scenario, "engine")
    args = engine_args(scenario)
    tls = merged_values(scenario)["tls"]["enabled"]
    # Kubelet gRPC probes cannot do TLS: with TLS they must use the plaintext health port.
    expected = args.health_port if tls else args.port
    assert expected is not None
    if tls:
        assert args.health_port != args.port
        assert args.health_port == merged_values(scenario)["engine"]["healthPort"]
        declared = {p["containerPort"] for p in c["ports"]}
        assert args.health_port in declared
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": expected}, probe
        assert set(c[probe]) & {"httpGet", "tcpSocket", "exec"} == set()
    # Model loading is covered by the startup probe, not by liveness restarts.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_engine_grace_period_covers_shutdown_timeout(scenario: str) -> None:
    spec = deployment(scenario, "engine")["spec"]["template"]["spec"]
    drain = engine_args(scenario).shutdown_timeout
    assert spec["terminationGracePeriodSeconds"] >= drain + 5
    assert spec["terminationGracePeriodSeconds"] == int(drain) + 15


def test_engine_grace_period_rounds_up_fractional_timeouts() -> None:
    docs = render({"engine": {"shutdownTimeout": 12.5, "terminationGracePeriodMarginSeconds": 0}})
    engine = yaml.safe_load(docs["tandem/templates/engine-deployment.yaml"])
    assert engine["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 13


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_engine_volumes(scenario: str) -> None:
    vols, mnts = volumes(scenario, "engine"), mounts(scenario, "engine")
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    assert mnts["dshm"]["mountPath"] == "/dev/shm"
    # The root filesystem is read-only: the embedded model cache is a writable emptyDir.
    cache_dir = env(scenario, "engine")["TANDEM_CACHE_DIR"]["value"]
    assert "emptyDir" in vols["cache"]
    assert cache_dir.startswith(mnts["cache"]["mountPath"])
    assert "emptyDir" in vols["tmp"] and mnts["tmp"]["mountPath"] == "/tmp"


def test_engine_model_from_existing_claim_on_gpu_pool() -> None:
    spec = deployment("gpu-pool", "engine")["spec"]["template"]["spec"]
    values = values_of("gpu-pool")["engine"]
    assert spec["volumes"][-1]["name"] == "model"
    assert volumes("gpu-pool", "engine")["model"]["persistentVolumeClaim"] == {
        "claimName": "llm-models",
        "readOnly": True,
    }
    assert mounts("gpu-pool", "engine")["model"] == {
        "name": "model",
        "mountPath": "/models",
        "readOnly": True,
    }
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == values["nodeSelector"]
    assert spec["tolerations"] == values["tolerations"]
    assert spec["affinity"] == values["affinity"]
    assert volumes("gpu-pool", "engine")["dshm"]["emptyDir"]["sizeLimit"] == "16Gi"
    # Gateways stay off the GPU pool.
    frontend = deployment("gpu-pool", "frontend")["spec"]["template"]["spec"]
    assert "nodeSelector" not in frontend and "runtimeClassName" not in frontend


def test_engine_model_on_a_new_claim() -> None:
    (pvc,) = objects("scale-out", "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["storageClassName"] == "filestore-rwx"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "200Gi"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    claim = volumes("scale-out", "engine")["model"]["persistentVolumeClaim"]
    assert claim == {"claimName": pvc["metadata"]["name"], "readOnly": True}
    assert engine_args("scale-out").model == "/models/Llama-3.1-8B-Instruct"


def test_engine_model_from_host_path() -> None:
    assert volumes("hostpath-cpu", "engine")["model"]["hostPath"] == {
        "path": "/mnt/models",
        "type": "Directory",
    }
    assert engine_args("hostpath-cpu").model == "/models/tiny-llama"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_engine_headless_service_selects_engine_pods(scenario: str) -> None:
    svc = headless_service(scenario)
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"].get("publishNotReadyAddresses", False) is False
    assert selects(svc["spec"]["selector"], pod_labels(scenario, "engine"))
    assert not selects(svc["spec"]["selector"], pod_labels(scenario, "frontend"))
    (port,) = svc["spec"]["ports"]
    assert port["port"] == engine_args(scenario).port
    assert port["targetPort"] == "grpc"


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("component", ["engine", "frontend"])
def test_pod_security(scenario: str, component: str) -> None:
    spec = deployment(scenario, component)["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(scenario, component)["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert "add" not in sc["capabilities"]
    selector = deployment(scenario, component)["spec"]["selector"]["matchLabels"]
    assert selects(selector, pod_labels(scenario, component))


# ---- gateway ----------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_gateway_targets_every_engine_through_the_headless_service(scenario: str) -> None:
    svc = headless_service(scenario)
    fqdn = f"{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    target = f"dns:///{fqdn}:{svc['spec']['ports'][0]['port']}"
    assert env(scenario, "frontend")["TANDEM_ENGINE"]["value"] == target


def gateway_config(scenario: str) -> Any:
    """The gateway's config as ``python -m frontend_svc`` builds it from the pod's env."""
    from frontend_svc.config import config_from_args

    c = container(scenario, "frontend")
    assert c["command"] == ["python", "-m", "frontend_svc"]
    environ = {
        name: e.get("value", f"<{name} from a Secret>")
        for name, e in env(scenario, "frontend").items()
    }
    return config_from_args(c.get("args", []), environ)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_gateway_env_is_what_the_gateway_reads(scenario: str) -> None:
    config = gateway_config(scenario)
    assert config.engine_address == env(scenario, "frontend")["TANDEM_ENGINE"]["value"]
    assert config.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container(scenario, "frontend")["ports"]}
    assert config.port == ports["http"] == merged_values(scenario)["frontend"]["port"]
    assert config.tls.enabled == merged_values(scenario)["tls"]["enabled"]
    assert config.workers == merged_values(scenario)["frontend"]["workers"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_gateway_http_probes(scenario: str) -> None:
    c = container(scenario, "frontend")
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_gateway_service(scenario: str) -> None:
    svc = one(scenario, "Service", "frontend")
    assert svc["spec"]["type"] == merged_values(scenario)["frontend"]["service"]["type"]
    assert selects(svc["spec"]["selector"], pod_labels(scenario, "frontend"))
    assert not selects(svc["spec"]["selector"], pod_labels(scenario, "engine"))
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    if scenario == "hostpath-cpu":
        assert svc["spec"]["ports"][0]["nodePort"] == 30080


def test_scale_out_three_engines_autoscaled_gateways() -> None:
    assert deployment("scale-out", "engine")["spec"]["replicas"] == 3
    # The HPA owns the gateway count: a fixed replicas field would fight it on every upgrade.
    assert "replicas" not in deployment("scale-out", "frontend")["spec"]
    hpa = one("scale-out", "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    frontend = deployment("scale-out", "frontend")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": frontend["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    targets = {
        m["resource"]["name"]: m["resource"]["target"]["averageUtilization"]
        for m in hpa["spec"]["metrics"]
    }
    assert targets == {"cpu": 60, "memory": 80}
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    # HPA utilization needs CPU requests on the pods it scales; about a core per gateway worker.
    assert container("scale-out", "frontend")["resources"]["requests"]["cpu"] == "2"
    assert gateway_config("scale-out").workers == 2
    assert gateway_config("default").workers == 1


def test_tool_calling_values_reach_the_gateway() -> None:
    from frontend_svc.config import config_from_args

    default = gateway_config("default")
    assert (default.tool_call_parser, default.enable_auto_tool_choice) == (None, False)
    assert default.reasoning_parser is None
    values = {
        "frontend": {
            "toolCallParser": "hermes",
            "enableAutoToolChoice": True,
            "reasoningParser": "qwen3",
        }
    }
    texts = [text for path, text in render(values).items() if not path.endswith("NOTES.txt")]
    docs = [doc for text in texts for doc in yaml.safe_load_all(text) if doc]
    [frontend] = [
        d
        for d in docs
        if d.get("kind") == "Deployment"
        and d["metadata"]["labels"].get("app.kubernetes.io/component") == "frontend"
    ]
    [c] = frontend["spec"]["template"]["spec"]["containers"]
    environ = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    config = config_from_args(c.get("args", []), environ)
    assert (config.tool_call_parser, config.enable_auto_tool_choice) == ("hermes", True)
    assert config.reasoning_parser == "qwen3"
    pdbs = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d
        for d in objects("scale-out", "PodDisruptionBudget")
    }
    assert set(pdbs) == {"engine", "frontend"}
    for component, pdb in pdbs.items():
        assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels("scale-out", component))
    # Without autoscaling the Deployment carries the count itself.
    assert deployment("default", "frontend")["spec"]["replicas"] == 2
    assert objects("default", "HorizontalPodAutoscaler") == []


def test_frontend_pdb_min_available() -> None:
    pdb = one("hostpath-cpu", "PodDisruptionBudget", "frontend")
    assert pdb["spec"] == {
        "minAvailable": 1,
        "selector": {"matchLabels": pdb["spec"]["selector"]["matchLabels"]},
    }


# ---- security: NetworkPolicy, API key, TLS ----------------------------------------------------


@pytest.mark.parametrize("scenario", ["default", "gpu-pool", "mtls", "scale-out"])
def test_network_policy_lets_only_gateways_reach_the_engine(scenario: str) -> None:
    (policy,) = objects(scenario, "NetworkPolicy")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    engine_labels = pod_labels(scenario, "engine")
    frontend_labels = pod_labels(scenario, "frontend")
    assert selects(spec["podSelector"]["matchLabels"], engine_labels)
    assert not selects(spec["podSelector"]["matchLabels"], frontend_labels)
    grpc_port = engine_args(scenario).port
    grpc_rules = [
        r for r in spec["ingress"] if {"port": grpc_port, "protocol": "TCP"} in r["ports"]
    ]
    assert len(grpc_rules) == 1
    (peer,) = grpc_rules[0]["from"]
    assert set(peer) == {"podSelector"}  # same namespace, gateway pods only
    assert selects(peer["podSelector"]["matchLabels"], frontend_labels)
    assert not selects(peer["podSelector"]["matchLabels"], engine_labels)
    # Any other rule opens only the plaintext health port (for kubelet probes), never gRPC.
    for rule in spec["ingress"]:
        if rule is not grpc_rules[0]:
            assert rule["ports"] == [{"port": engine_args(scenario).health_port, "protocol": "TCP"}]
            assert "from" not in rule


def test_network_policy_extra_peers() -> None:
    peer = {"namespaceSelector": {"matchLabels": {"team": "batch"}}}
    docs = render({"networkPolicy": {"extraFrom": [peer]}})
    policy = yaml.safe_load(docs["tandem/templates/engine-networkpolicy.yaml"])
    assert policy["spec"]["ingress"][0]["from"][1] == peer
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)


def test_api_key_from_an_existing_secret() -> None:
    ref = env("gpu-pool", "frontend")["TANDEM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "tandem-api", "key": "token"}
    assert objects("gpu-pool", "Secret") == []  # the chart never makes one then


def test_api_key_secret_made_by_the_chart() -> None:
    (secret,) = objects("mtls", "Secret")
    ref = env("mtls", "frontend")["TANDEM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "api-key"}
    assert base64.b64decode(secret["data"]["api-key"]).decode() == "s3cret-key"
    # The key never appears in the pod spec itself, and pods roll when it changes.
    assert "s3cret-key" not in yaml.safe_dump(deployment("mtls", "frontend"))
    annotations = deployment("mtls", "frontend")["spec"]["template"]["metadata"]["annotations"]
    assert len(annotations["checksum/api-key"]) == 64


def test_no_api_key_by_default_and_notes_warn() -> None:
    assert "TANDEM_API_KEY" not in env("default", "frontend")
    notes = render({})["tandem/templates/NOTES.txt"]
    assert "WARNING: no API key" in notes
    assert f"dns:///{RELEASE}-tandem-engine-headless.{NAMESPACE}.svc.cluster.local:50051" in notes


def test_mutual_tls_from_secrets() -> None:
    fqdn = f"{headless_service('mtls')['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    # Engine: its server pair and the CA that must have signed the gateway's client certificate.
    engine_tls = volumes("mtls", "engine")["tls"]["secret"]
    assert engine_tls["secretName"] == "tandem-engine-tls"
    mount = mounts("mtls", "engine")["tls"]
    assert mount["readOnly"] is True
    args = engine_args("mtls")
    assert args.tls_cert == f"{mount['mountPath']}/tls.crt"
    assert args.tls_key == f"{mount['mountPath']}/tls.key"
    assert args.tls_ca == f"{mount['mountPath']}/ca.crt"  # --tls-ca: client certificates required
    # Gateway: the CA that signed the engine, its client pair, and the name in the engine cert.
    frontend_tls = volumes("mtls", "frontend")["tls"]["secret"]
    assert frontend_tls["secretName"] == "tandem-gateway-tls"
    fmount = mounts("mtls", "frontend")["tls"]
    assert fmount["readOnly"] is True
    config = gateway_config("mtls")
    assert config.tls.ca == f"{fmount['mountPath']}/ca.crt"
    assert config.tls.cert == f"{fmount['mountPath']}/tls.crt"
    assert config.tls.key == f"{fmount['mountPath']}/tls.key"
    assert config.tls.server_name == fqdn
    # Secret files readable by the pod's group (fsGroup) only.
    for component in ("engine", "frontend"):
        assert volumes("mtls", component)["tls"]["secret"]["defaultMode"] == 0o440
        assert deployment("mtls", component)["spec"]["template"]["spec"]["securityContext"][
            "fsGroup"
        ]


def test_server_only_tls() -> None:
    values = {"tls": {"enabled": True, "mutual": False, "engineSecret": "e", "frontendSecret": "f"}}
    docs = render(values)
    engine = yaml.safe_load(docs["tandem/templates/engine-deployment.yaml"])
    args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--tls-cert" in args and "--tls-ca" not in args  # no client certificates required
    frontend = yaml.safe_load(docs["tandem/templates/frontend-deployment.yaml"])
    names = {e["name"] for e in frontend["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "TANDEM_TLS_CA" in names and "TANDEM_TLS_CERT" not in names


@pytest.mark.parametrize("scenario", ["default", "gpu-pool", "scale-out", "hostpath-cpu"])
def test_plaintext_has_no_tls_material(scenario: str) -> None:
    args = engine_args(scenario)
    assert (args.tls_cert, args.tls_key, args.tls_ca, args.health_port) == (None,) * 4
    assert "tls" not in volumes(scenario, "engine")
    assert not any(name.startswith("TANDEM_TLS_") for name in env(scenario, "frontend"))


def test_service_monitor() -> None:
    monitor = one("mtls", "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    svc = one("mtls", "Service", "frontend")
    assert selects(monitor["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert not selects(
        monitor["spec"]["selector"]["matchLabels"], headless_service("mtls")["metadata"]["labels"]
    )
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == svc["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics"
    assert objects("default", "ServiceMonitor") == []  # off by default


def test_chart_readme_documents_every_top_level_value() -> None:
    readme = (CHART / "README.md").read_text()
    for section, values in merged_values("default").items():
        if isinstance(values, dict) and values:
            for key in values:
                assert f"`{section}.{key}" in readme, f"{section}.{key} missing from README"
        else:
            assert f"`{section}`" in readme, f"{section} missing from README"
