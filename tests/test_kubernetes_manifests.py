"""deploy/kubernetes/ and the Dockerfile: valid objects (strict schemas: a misspelt field fails) that say
what the deployment needs (locked-down container, read-only host mounts, probes, ports, resources, real
gpuwatch flags), and an image that matches them. Docker cannot run here: the Dockerfile is read, not built.

Core kinds are checked with kubernetes-validate's strict schemas (no unknown field anywhere); the
Prometheus Operator's ServiceMonitor and PodMonitor have no schema there, so MONITOR_SCHEMAS below,
written from the operator's CRDs, checks them.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError, VersionNotSupportedError

YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser where PyYAML has it: the same documents, faster

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

# The oldest Kubernetes these manifests are meant for, and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.28", kubernetes_validate.latest_version())
MONITOR_KINDS = ("ServiceMonitor", "PodMonitor")
RSS_64_GPUS = 68.5e6  # bytes, docs/performance.md: VmRSS after 300 polls, H200 x 64


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.load_all(path.read_text(), Loader=YAML_LOADER) if doc]


MANIFESTS = sorted(p for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")
DOCUMENTS = [(path.name, doc) for path in MANIFESTS for doc in _documents(path)]


def _one(kind: str) -> dict:
    found = [doc for _, doc in DOCUMENTS if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/kubernetes, found {len(found)}"
    return found[0]


DAEMONSET = _one("DaemonSet")
POD = DAEMONSET["spec"]["template"]["spec"]
CONTAINER = POD["containers"][0]


def _doc_id(item: tuple[str, dict]) -> str:
    return f"{item[0]}:{item[1]['kind']}"


# -- Prometheus Operator monitors ------------------------------------------------------------------
# From the CRDs of prometheus-operator v0.93.0 (example/prometheus-operator-crd/
# monitoring.coreos.com_{servicemonitors,podmonitors}.yaml; the API reference at
# prometheus-operator.dev/docs/api-reference/api/). Every field of the CRDs is allowed by name
# (additionalProperties false: a misspelt field fails); the ones these manifests use have their
# types, patterns and enums; the label-name patterns are Prometheus 2.x's, stricter than the CRD.

_DURATION = {"type": "string",
             "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_LABEL_NAME = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_RELABEL_ACTIONS = ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod", "labelmap", "LabelMap",
                    "labeldrop", "LabelDrop", "labelkeep", "LabelKeep", "lowercase", "Lowercase", "uppercase",
                    "Uppercase", "keepequal", "KeepEqual", "dropequal", "DropEqual"]
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "action": {"type": "string", "enum": _RELABEL_ACTIONS},
        "modulus": {"type": "integer", "minimum": 0},
        "regex": {"type": "string"},
        "replacement": {"type": "string"},
        "separator": {"type": "string"},
        "sourceLabels": {"type": "array", "items": _LABEL_NAME},
        "targetLabel": _LABEL_NAME,
    },
}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": _STRING_MAP,
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["key", "operator"],
            "properties": {"key": {"type": "string"},
                           "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                           "values": {"type": "array", "items": {"type": "string"}}}}},
    },
}
_NAMESPACE_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
}
_ENDPOINT_COMMON = {
    "port": {"type": "string"},
    "targetPort": {"type": ["integer", "string"]},
    "path": {"type": "string", "pattern": "^/"},
    "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
    "interval": _DURATION,
    "scrapeTimeout": _DURATION,
    "honorLabels": {"type": "boolean"},
    "honorTimestamps": {"type": "boolean"},
    "relabelings": {"type": "array", "items": _RELABEL},
    "metricRelabelings": {"type": "array", "items": _RELABEL},
    "params": {"type": "object"},
    **{name: {} for name in ("authorization", "basicAuth", "bearerTokenSecret", "enableHttp2", "filterRunning",
                             "followRedirects", "noProxy", "oauth2", "proxyConnectHeader", "proxyFromEnvironment",
                             "proxyUrl", "tlsConfig", "trackTimestampsStaleness")},
}
_SPEC_COMMON = {
    "selector": _LABEL_SELECTOR,
    "namespaceSelector": _NAMESPACE_SELECTOR,
    "jobLabel": {"type": "string"},
    "podTargetLabels": {"type": "array", "items": {"type": "string"}},
    "sampleLimit": {"type": "integer", "minimum": 0},
    **{name: {} for name in ("attachMetadata", "bodySizeLimit", "convertClassicHistogramsToNHCB",
                             "fallbackScrapeProtocol", "keepDroppedTargets", "labelLimit", "labelNameLengthLimit",
                             "labelValueLengthLimit", "nativeHistogramBucketLimit", "nativeHistogramMinBucketFactor",
                             "scrapeClass", "scrapeClassicHistograms", "scrapeNativeHistograms", "scrapeProtocols",
                             "selectorMechanism", "targetLimit")},
}


def _monitor_schema(kind: str, endpoints_key: str, endpoint_extra: dict, spec_extra: dict) -> dict:
    endpoint = {"type": "object", "additionalProperties": False, "required": ["port"],
                "properties": {**_ENDPOINT_COMMON, **endpoint_extra}}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": {"type": "object", "additionalProperties": False, "required": ["name", "namespace"],
                         "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                                        "labels": _STRING_MAP, "annotations": _STRING_MAP}},
            "spec": {"type": "object", "additionalProperties": False, "required": ["selector", endpoints_key],
                     "properties": {**_SPEC_COMMON, **spec_extra,
                                    endpoints_key: {"type": "array", "minItems": 1, "items": endpoint}}},
        },
    }


MONITOR_SCHEMAS = {
    "ServiceMonitor": _monitor_schema(
        "ServiceMonitor", "endpoints", {"bearerTokenFile": {"type": "string"}},
        {"targetLabels": {"type": "array", "items": {"type": "string"}}, "serviceDiscoveryRole": {}}),
    "PodMonitor": _monitor_schema(
        "PodMonitor", "podMetricsEndpoints", {"portNumber": {"type": "integer", "minimum": 1, "maximum": 65535}}, {}),
}


def _validate(doc: dict, version: str) -> None:
    """One object against its schema: kubernetes-validate's strict one, or MONITOR_SCHEMAS."""
    if doc["kind"] in MONITOR_KINDS:
        jsonschema.Draft202012Validator(MONITOR_SCHEMAS[doc["kind"]]).validate(doc)
        return
    problem = None
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        problem = f"{doc['kind']} {doc['metadata']['name']} (Kubernetes {exc.version}): {where}: {exc.message}"
    except (SchemaNotFoundError, VersionNotSupportedError) as exc:
        problem = f"{doc['kind']}: kubernetes-validate cannot check it: {exc.message}"
    if problem:
        pytest.fail(problem)  # outside the except: one line, not the schema dump of the chained error


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("item", DOCUMENTS, ids=_doc_id)
def test_every_object_is_valid_in_strict_mode(item, version):
    _validate(item[1], version)


def test_strict_validation_catches_a_misspelt_field():
    """The check above is only worth something if an unknown field fails, deep in a pod template too."""
    broken = copy.deepcopy(DAEMONSET)
    security = broken["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    security["readOnlyRootFilesytem"] = security.pop("readOnlyRootFilesystem")
    with pytest.raises(ValidationError, match="readOnlyRootFilesytem"):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)
    for kind, key in (("ServiceMonitor", "endpoints"), ("PodMonitor", "podMetricsEndpoints")):
        monitor = copy.deepcopy(_one(kind))
        monitor["spec"][key][0]["intervall"] = monitor["spec"][key][0].pop("interval")
        with pytest.raises(jsonschema.ValidationError, match="intervall"):
            jsonschema.Draft202012Validator(MONITOR_SCHEMAS[kind]).validate(monitor)


def test_kustomization_lists_namespace_daemonset_and_service_not_the_monitors():
    text = (KUBE / "kustomization.yaml").read_text()
    kustomization = yaml.load(text, Loader=YAML_LOADER)
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert sorted(resources) == ["daemonset.yaml", "namespace.yaml", "service.yaml"]
    for name in resources:
        assert (KUBE / name).is_file(), name
    for monitor in ("servicemonitor.yaml", "podmonitor.yaml"):
        assert (KUBE / monitor).is_file()
        assert re.search(rf"^#.*{re.escape(monitor)}", text, re.M), f"kustomization.yaml should say to add {monitor}"
    assert {p.name for p in MANIFESTS} == set(resources) | {"servicemonitor.yaml", "podmonitor.yaml"}


def test_readme_names_every_file():
    readme = (KUBE / "README.md").read_text()
    for path in [*MANIFESTS, KUBE / "kustomization.yaml"]:
        assert f"`{path.name}`" in readme, path.name
    assert "kubectl apply -k deploy/kubernetes" in readme


def test_everything_lives_in_the_gpuwatch_namespace():
    namespace = _one("Namespace")
    assert namespace["metadata"]["name"] == "gpuwatch"
    for name, doc in DOCUMENTS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "gpuwatch", name
    for kind in MONITOR_KINDS:
        assert _one(kind)["spec"]["namespaceSelector"]["matchNames"] == ["gpuwatch"]


# -- the DaemonSet -------------------------------------------------------------------------------

def test_runs_only_on_gpu_nodes_and_tolerates_their_taint():
    assert POD["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in POD["tolerations"]


def test_the_nvidia_toolkit_provides_nvml():
    assert POD["runtimeClassName"] == "nvidia"
    env = {e["name"]: e for e in CONTAINER["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # no GPU taken from the scheduler: gpuwatch watches every GPU without allocating one
    assert not any(k.startswith("nvidia.com/") for part in CONTAINER["resources"].values() for k in part)


def test_no_host_namespaces_and_no_api_token():
    for field in ("hostPID", "hostNetwork", "hostIPC"):
        assert POD.get(field, False) is False, field
    assert POD["automountServiceAccountToken"] is False
    assert POD["terminationGracePeriodSeconds"] == 10
    assert DAEMONSET["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}


def test_container_is_locked_down():
    security = CONTAINER["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security.get("privileged", False) is False
    assert security["capabilities"] == {"drop": ["ALL"]}  # and nothing added
    seccomp = security.get("seccompProfile") or POD.get("securityContext", {}).get("seccompProfile")
    assert seccomp == {"type": "RuntimeDefault"}
    # UID 0 for the kubelet's root-owned pod-resources socket (README.md); never root by accident
    assert isinstance(security["runAsUser"], int)
    if security["runAsUser"] == 0:
        assert security["runAsNonRoot"] is False
        assert "--collector.kubernetes.socket" in _flags(), "UID 0 is only for the pod-resources socket"
    else:
        assert security["runAsNonRoot"] is True


def _volumes() -> dict[str, dict]:
    return {v["name"]: v for v in POD["volumes"]}


def _mounts() -> dict[str, dict]:
    """mountPath -> the hostPath volume's path and the mount."""
    volumes = _volumes()
    return {m["mountPath"]: {"host": volumes[m["name"]].get("hostPath", {}).get("path"), **m}
            for m in CONTAINER["volumeMounts"]}


def test_every_host_path_is_mounted_read_only():
    volumes = _volumes()
    for mount in CONTAINER["volumeMounts"]:
        if "hostPath" in volumes[mount["name"]]:
            assert mount.get("readOnly") is True, mount["name"]
            assert volumes[mount["name"]]["hostPath"].get("type") == "Directory", mount["name"]
    mounts = _mounts()
    assert mounts["/var/lib/kubelet/pod-resources"]["host"] == "/var/lib/kubelet/pod-resources"
    assert mounts["/host/proc"]["host"] == "/proc"
    assert mounts["/host/sys/fs/cgroup"]["host"] == "/sys/fs/cgroup"


def test_the_flags_point_into_the_mounts():
    args = _args()
    mounts = _mounts()
    assert mounts[args["--attribution.proc-root"]]["host"] == "/proc"
    assert mounts[args["--attribution.cgroup-root"]]["host"] == "/sys/fs/cgroup"
    socket = Path(args["--collector.kubernetes.socket"])
    assert socket.name == "kubelet.sock"
    assert mounts[str(socket.parent)]["host"] == "/var/lib/kubelet/pod-resources"
    assert args["--log.format"] == "json"


def test_probes_liveness_on_the_server_readiness_on_healthz():
    """A restart cannot load a driver or unwedge NVML (gpuwatch recovers by itself): liveness asks only
    that the server answers (/), readiness that collection works (/healthz); both on the metrics port."""
    liveness, readiness = CONTAINER["livenessProbe"], CONTAINER["readinessProbe"]
    assert liveness["httpGet"]["path"] == "/" and readiness["httpGet"]["path"] == "/healthz"
    for probe in (liveness, readiness):
        assert probe["httpGet"]["port"] in (19400, "metrics")
    assert (liveness["periodSeconds"], liveness["failureThreshold"], liveness["initialDelaySeconds"]) == (10, 3, 10)


def test_port_19400_is_named_metrics_everywhere():
    assert CONTAINER["ports"] == [{"name": "metrics", "containerPort": 19400, "protocol": "TCP"}]
    assert _args()["--web.listen-address"] == ":19400"
    service = _one("Service")
    assert service["spec"]["ports"][0]["name"] == "metrics"
    assert service["spec"]["ports"][0]["port"] == 19400
    assert service["spec"]["ports"][0]["targetPort"] in ("metrics", 19400)
    assert _one("ServiceMonitor")["spec"]["endpoints"][0]["port"] == "metrics"
    assert _one("PodMonitor")["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_selectors_match_the_pods():
    labels = DAEMONSET["spec"]["template"]["metadata"]["labels"]
    service = _one("Service")
    for selector in (DAEMONSET["spec"]["selector"]["matchLabels"], service["spec"]["selector"],
                     _one("PodMonitor")["spec"]["selector"]["matchLabels"]):
        assert selector and selector.items() <= labels.items(), selector
    service_monitor = _one("ServiceMonitor")["spec"]["selector"]["matchLabels"]
    assert service_monitor and service_monitor.items() <= service["metadata"]["labels"].items()
    assert "app.kubernetes.io/version" not in DAEMONSET["spec"]["selector"]["matchLabels"]  # immutable selector


def test_monitors_scrape_metrics_every_15s_with_the_node_as_instance():
    for endpoint in (_one("ServiceMonitor")["spec"]["endpoints"][0], _one("PodMonitor")["spec"]["podMetricsEndpoints"][0]):
        assert endpoint["interval"] == "15s"
        assert endpoint["path"] == "/metrics"
        assert "--web.telemetry-path" not in _args()  # gpuwatch's default path is /metrics
        targets = {r["targetLabel"]: r for r in endpoint["relabelings"]}
        for label in ("node", "instance"):
            assert targets[label]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
            assert targets[label].get("action", "replace") == "replace"
            assert targets[label].get("regex", "(.*)") == "(.*)"
            assert targets[label].get("replacement", "$1") == "$1"


def _bytes(quantity: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 1e3, "M": 1e6, "G": 1e9, "": 1}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", quantity).groups()
    return float(number) * units[unit]


def test_resources_follow_the_measured_figures():
    resources = CONTAINER["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert resources["requests"]["cpu"] == "20m"
    assert _bytes(resources["requests"]["memory"]) >= RSS_64_GPUS  # the scheduler reserves the 64-GPU RSS
    assert _bytes(resources["limits"]["memory"]) >= 2 * RSS_64_GPUS
    assert "cpu" not in resources["limits"], "no CPU limit: CFS throttling would delay polls"


# -- the flags are gpuwatch's -------------------------------------------------------------------

def _raw_args() -> list[str]:
    assert "command" not in CONTAINER, "the image's ENTRYPOINT is gpuwatch; set args only"
    return CONTAINER["args"]


def _args() -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in _raw_args()[1:])


def _flags() -> list[str]:
    return [arg.split("=", 1)[0] for arg in _raw_args()[1:]]


@pytest.fixture(scope="module")
def help_flags() -> set[str]:
    gpuwatch = Path(sys.executable).with_name("gpuwatch")
    assert gpuwatch.exists(), gpuwatch
    result = subprocess.run([str(gpuwatch), "run", "--help"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9.-]*[a-z0-9]", result.stdout))


def test_args_run_the_daemon_with_one_value_per_flag():
    args = _raw_args()
    assert args[0] == "run"
    for arg in args[1:]:
        assert re.fullmatch(r"--[a-z][a-z0-9.-]*=\S+", arg), f"{arg!r}: write --flag=value, one per item"
    assert len(_flags()) == len(set(_flags()))


@pytest.mark.daemon
@pytest.mark.parametrize("flag", _flags())
def test_every_flag_is_a_gpuwatch_flag(flag, help_flags):
    assert flag in help_flags, f"{flag} is not an option of `gpuwatch run`"


# -- the Dockerfile (read, not built: no Docker here) ----------------------------------------------

def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines()
                                         if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip() if " " in line.strip() else "")
            for line in (raw.strip() for raw in text.splitlines()) if line]


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for instruction in _instructions():
        if instruction[0] == "FROM":
            stages.append([])
        assert stages, f"{instruction} before the first FROM"
        stages[-1].append(instruction)
    return stages


def _all(stage: list[tuple[str, str]], name: str) -> list[str]:
    return [args for instruction, args in stage if instruction == name]


def test_dockerfile_builds_the_wheel_then_installs_it_with_the_kubernetes_extra():
    builder, runtime = _stages()
    assert re.fullmatch(r"python:3\.12-slim AS builder", _all(builder, "FROM")[0], re.I)
    assert _all(runtime, "FROM") == ["python:3.12-slim"]
    assert any("pip wheel" in run and "--no-deps" in run and "-w /wheels ." in run for run in _all(builder, "RUN"))
    assert "--from=builder /wheels /wheels" in _all(runtime, "COPY")
    install = " ".join(_all(runtime, "RUN"))
    assert '"$(ls /wheels/*.whl)[kubernetes]"' in install and "--no-cache-dir" in install
    assert not re.search(r"nvidia|libnvidia|cuda", install, re.I), "the container toolkit mounts libnvidia-ml"


def test_dockerfile_runs_gpuwatch_as_the_daemonsets_user_on_its_port():
    runtime = _stages()[-1]
    user = _all(runtime, "USER")[-1]
    assert re.fullmatch(r"\d+(:\d+)?", user), f"USER {user}: numeric, so runAsNonRoot checks can work"
    assert int(user.split(":")[0]) == CONTAINER["securityContext"]["runAsUser"]
    assert _all(runtime, "EXPOSE") == [str(CONTAINER["ports"][0]["containerPort"])]
    assert json.loads(_all(runtime, "ENTRYPOINT")[-1]) == ["gpuwatch"]
    assert json.loads(_all(runtime, "CMD")[-1]) == ["run"] == _raw_args()[:1]
    env = " ".join(_all(runtime, "ENV"))
    assert re.search(r"\bPYTHONDONTWRITEBYTECODE=1\b", env), "the root file system is read-only"
    assert not _all(runtime, "HEALTHCHECK"), "Kubernetes probes /healthz"


def test_image_version_matches_the_package_and_the_daemonset():
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    labels = " ".join(_all(_stages()[-1], "LABEL"))
    for key in ("title", "description", "version", "source", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert f"ARG VERSION={version}" in DOCKERFILE.read_text()
    assert CONTAINER["image"] == f"ghcr.io/gpuwatch/gpuwatch:{version}"
    assert DAEMONSET["metadata"]["labels"]["app.kubernetes.io/version"] == version


def test_dockerignore_lets_in_what_the_builder_copies():
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", "an allow-list: nothing but what is copied reaches the build context"
    builder = _stages()[0]
    for copy_args in _all(builder, "COPY"):
        *sources, _ = shlex.split(copy_args)
        for source in sources:
            assert f"!{source.rstrip('/')}" in patterns, f"{source} is copied but excluded by .dockerignore"
            assert (ROOT / source).exists(), source
