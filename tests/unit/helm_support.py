"""Shared by the Helm chart tests: the value sets, rendering through the real Helm engine
(helm-python-sdk binds Helm's Go SDK: no helm binary, no cluster), manifest accessors, and
the options of the real `tandem <role> --help`.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import yaml
from help_options import help_options
from keda_chart import KEDA_VALUES

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "tandem"
RELEASE = "demo"
NAMESPACE = "llm"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion: grpc probes are GA in
# 1.27) and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
ENGINE_ROLES = ("prefill", "decode")
TANDEM_ROLES = ("router", "prefill", "decode", "kvstore")
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "external-redis": {
        "redis": {"enabled": False, "external": {"url": "redis://redis.infra.svc:6380/2"}},
    },
    "external-redis-secret": {
        "redis": {"enabled": False, "external": {"existingSecret": "redis-cred"}},
    },
    "3-prefill-5-decode": {"prefill": {"replicas": 3}, "decode": {"replicas": 5}},
    "no-gpu": {"prefill": {"gpus": 0}, "decode": {"gpus": 0}},
    "tensor-pipeline-parallel": {
        "prefill": {"gpus": 4, "tensorParallelSize": 2, "pipelineParallelSize": 2},
        "decode": {"gpus": 2, "tensorParallelSize": 2, "enableExpertParallel": True},
    },
    "internal-tls": {"internalTLS": {"enabled": True, "secretName": "tandem-internal-tls"}},
    "tracing": {"tracing": {"otlpTracesEndpoint": "http://otel-collector.observability:4317",
                            "otlpTracesProtocol": "grpc"}},
    "ingress": {
        "router": {
            "ingress": {
                "enabled": True,
                "className": "nginx",
                "hosts": [
                    {"host": "llm.example.org", "paths": [{"path": "/", "pathType": "Prefix"}]}
                ],
                "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.org"]}],
            }
        }
    },
    "production": {
        "model": {
            "path": "/models/llama",
            "file": "",
            "source": "pvc",
            "pvc": {"claimName": "weights", "subPath": "Llama-3.1-8B-Instruct"},
            "servedModelName": "llama-3.1-8b",
            "quantization": "int8",
            "dtype": "bfloat16",
            "modelImpl": "transformers",
            "maxModelLen": 32768,
        },
        "cache": {"blockSize": 32},
        "router": {
            "apiKey": {"existingSecret": "tandem-api"},
            "service": {"type": "LoadBalancer"},
            "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
        },
        "prefill": {
            "cache": {"kvCacheMemoryBytes": 40 * 2**30, "gpuMemoryUtilization": 0.85},
            "scheduler": {"maxNumBatchedTokens": 16384, "maxNumSeqs": 32},
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 10},
            "extraArgs": ["--max-num-seqs=48"],
        },
        "decode": {
            "affinity": {
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {
                                    "matchLabels": {"app.kubernetes.io/component": "decode"}
                                },
                            },
                        }
                    ]
                }
            },
            "speculative": {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 3},
        },
        "kvstore": {"kind": "DaemonSet", "capacity": 64 * 2**30,
                    "disk": {"enabled": True, "capacity": 800 * 2**30,
                             "mountPath": "/var/lib/tandem/kvstore",
                             "hostPath": "/mnt/nvme0/tandem-kv"}},
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "env": {"TANDEM_LOG_LEVEL": "debug"},
    },
    "keda": KEDA_VALUES,
    "hostpath-nodeport": {
        "model": {
            "path": "/models/qwen",
            "file": "",
            "source": "hostPath",
            "hostPath": {"path": "/mnt/models/Qwen2.5-7B-Instruct"},
        },
        "router": {"service": {"type": "NodePort"}, "routingPolicy": "least_loaded"},
        "redis": {"persistence": {"enabled": True, "storageClassName": "fast"}},
        "kvstore": {"replicas": 3, "resources": {"limits": {"memory": "12Gi"}},
                    "disk": {"enabled": True, "capacity": 50 * 2**30,
                             "mountPath": "/var/lib/tandem/kvstore"}},
        "serviceAccount": {"create": False, "name": "llm-runner"},
    },
}


@functools.cache
def render(name: str) -> tuple[dict[str, str], tuple[dict[str, Any], ...]]:
    """Renders one value set: (raw files by template path, parsed manifests)."""
    with helm.Chart.load(CHART) as loaded:
        files = loaded.render(VALUE_SETS[name], name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [doc for doc in yaml.safe_load_all(text) if doc]
    return files, tuple(docs)


def manifests(name: str) -> tuple[dict[str, Any], ...]:
    """Parsed manifests of one value set (rendered once per session)."""
    return render(name)[1]


def by_kind(docs: tuple[dict[str, Any], ...], kind: str) -> dict[str, dict[str, Any]]:
    """Objects of one kind by name."""
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """Deployments, StatefulSets and DaemonSets."""
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def component(doc: dict[str, Any]) -> str:
    """The app.kubernetes.io/component label: router, prefill, decode, kvstore, redis."""
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def workload_of(docs: tuple[dict[str, Any], ...], role: str) -> dict[str, Any]:
    """The one workload of a component."""
    found = [w for w in workloads(docs) if component(w) == role]
    assert len(found) == 1, f"expected one {role} workload, found {len(found)}"
    return found[0]


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    """A workload's pod containers."""
    return workload["spec"]["template"]["spec"]["containers"]


def tandem_containers(docs: tuple[dict[str, Any], ...]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(role, container) for every container that runs `tandem <role>`."""
    for w in workloads(docs):
        for c in containers(w):
            if c.get("command", [""])[0] == "tandem":
                yield c["command"][1], c


def flag_values(container: dict[str, Any]) -> dict[str, str]:
    """--flag=value args as a dict (the chart uses the = form for every flag with a
    value; a switch such as --enable-expert-parallel maps to "true"); last one wins."""
    out: dict[str, str] = {}
    for arg in container.get("args", []):
        assert arg.startswith("--"), f"arg {arg!r} is not --flag=value or a --switch"
        flag, sep, value = arg.partition("=")
        out[flag] = value if sep else "true"
    return out


def host_port(address: str) -> tuple[str, int]:
    """Splits HOST:PORT."""
    host, _, port = address.rpartition(":")
    return host, int(port)


# ---- the real CLI's flags --------------------------------------------------------------

@functools.cache
def cli_options(role: str) -> dict[str, frozenset[str] | None]:
    """Options `tandem <role> --help` lists -> their choices ({a,b} metavars) or None.

    Runs the installed console script's code in a subprocess, exactly as a container would.
    Raises AssertionError with the command's stderr when the command does not exist yet or
    fails to print its help.
    """
    # The console script next to this interpreter (the venv's), as the image runs it.
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.run(
        [str(tandem), role, "--help"], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, f"`tandem {role} --help` failed:\n{proc.stderr[-2000:]}"
    options: dict[str, frozenset[str] | None] = {}
    for option, rest in help_options(proc.stdout).items():
        if not option.startswith("--"):
            continue
        choices = None
        if rest.startswith("{") and rest.split()[0].endswith("}"):
            choices = frozenset(rest.split()[0][1:-1].split(","))
        options[option] = choices
    assert options, f"no options found in `tandem {role} --help`:\n{proc.stdout}"
    return options


def container_ports(container: dict[str, Any]) -> tuple[set[str], set[int]]:
    """(port names, port numbers) a container declares."""
    ports = container.get("ports", [])
    return {p["name"] for p in ports if "name" in p}, {p["containerPort"] for p in ports}


def resolve_port(container: dict[str, Any], port: int | str) -> int:
    """The number of a probe/targetPort `port` (name or number) among the container's ports."""
    for p in container.get("ports", []):
        if port in (p.get("name"), p["containerPort"]):
            return int(p["containerPort"])
    raise AssertionError(f"{container['name']}: probe port {port!r} is not a container port")


def listen_port(role: str, flags: dict[str, str]) -> dict[str, int]:
    """Which port each endpoint of a role listens on, from its own flags."""
    if role == "router":
        return {"http": int(flags["--port"]), "grpc": int(flags["--grpc-port"])}
    if role == "kvstore":
        return {"ucx": host_port(flags["--listen"])[1], "metrics": int(flags["--metrics-port"])}
    return {"grpc": host_port(flags["--listen"])[1], "metrics": int(flags["--metrics-port"])}


def env_value(docs: tuple[dict[str, Any], ...], c: dict[str, Any], var: str) -> Any:
    """A container's variable: its env value or valueFrom, else its envFrom ConfigMap's."""
    for e in c.get("env", []):
        if e["name"] == var:
            return e.get("value", e.get("valueFrom"))
    for source in c.get("envFrom", []):
        data = by_kind(docs, "ConfigMap")[source["configMapRef"]["name"]]["data"]
        if var in data:
            return data[var]
    raise AssertionError(f"{var} not set")


def pod_labels(w: dict[str, Any]) -> dict[str, str]:
    """Labels of a workload's pod template."""
    return w["spec"]["template"]["metadata"]["labels"]


def merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    """Deep-merges `new` into `into` as Helm merges --set values (later wins)."""
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value
