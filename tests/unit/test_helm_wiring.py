"""The Helm chart's wiring, checked on rendered manifests: what no schema sees.

Each flag a container passes is an option of the real `tandem <role> --help`; probes hit
the health endpoints on ports the process listens on; GPUs go only to prefill and decode;
every $(VAR) resolves; Redis, KV store and model volume are reached where they are;
selectors match pod labels. Real redis-server and UCX's own config parser check the
Redis command line and the UCX settings.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from ports import free_port
from waiting import wait_until

helm = pytest.importorskip("helm_python")

from helm_support import (  # noqa: E402  (after the importorskip)
    ENGINE_ROLES,
    TANDEM_ROLES,
    VALUE_SETS,
    by_kind,
    cli_options,
    component,
    container_ports,
    containers,
    env_value,
    flag_values,
    host_port,
    listen_port,
    manifests,
    pod_labels,
    resolve_port,
    tandem_containers,
    workload_of,
    workloads,
)


@pytest.mark.parametrize("role", TANDEM_ROLES)
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_flags_accepted_by_cli(name: str, role: str) -> None:
    """Each --flag=value a container passes is an option of the real `tandem <role>`, and
    a value of an option with choices is one of them."""
    found = [c for r, c in tandem_containers(manifests(name)) if r == role]
    assert len(found) == 1, f"expected one `tandem {role}` container"
    options = cli_options(role)
    for flag, value in flag_values(found[0]).items():
        assert flag in options, f"`tandem {role}` has no option {flag} ({sorted(options)})"
        choices = options[flag]
        if choices is not None:
            assert value in choices, f"{role} {flag}={value} not in {sorted(choices)}"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_required_wiring_present(name: str) -> None:
    """Each role gets the flags the contract says it needs."""
    required = {
        "router": {"--port", "--grpc-port", "--model", "--redis-url"},
        "prefill": {"--listen", "--model", "--redis-url", "--advertise-address", "--kvstore"},
        "decode": {"--listen", "--model", "--redis-url", "--advertise-address", "--kvstore"},
        "kvstore": {"--listen", "--capacity", "--redis-url", "--metrics-port"},
    }
    for role, container in tandem_containers(manifests(name)):
        missing = required[role] - set(flag_values(container))
        assert not missing, f"{role} lacks {missing}"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_probes_hit_health_endpoints_on_listening_ports(name: str) -> None:
    for role, c in tandem_containers(manifests(name)):
        listens = listen_port(role, flag_values(c))
        # Declared container ports are exactly the ports the process listens on.
        names, numbers = container_ports(c)
        assert numbers == set(listens.values()), (role, numbers, listens)
        assert names == set(listens), (role, names)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            assert probe, f"{role} has no {kind}"
            if role in ENGINE_ROLES:
                # grpc.health.v1 is served on the --listen port; with internal TLS the
                # kubelet (no TLS in its gRPC probe) only connects to it.
                how = "tcpSocket" if "--tls-cert" in flag_values(c) else "grpc"
                assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {how}
                assert resolve_port(c, probe[how]["port"]) == listens["grpc"]
            else:
                # The router is ready only once it can reach an engine (/ready answers 200
                # then, 503 before), but alive as long as it answers at all (/health).
                ready_path = "/ready" if role == "router" and kind == "readinessProbe" \
                    else "/health"
                assert probe["httpGet"]["path"] == ready_path, (role, kind)
                endpoint = "http" if role == "router" else "metrics"
                assert resolve_port(c, probe["httpGet"]["port"]) == listens[endpoint]


def test_bundled_redis_probe_and_port() -> None:
    redis = workload_of(manifests("default"), "redis")
    (c,) = containers(redis)
    port = int(c["args"][c["args"].index("--port") + 1])
    assert container_ports(c)[1] == {port}
    assert c["readinessProbe"]["exec"]["command"] == ["redis-cli", "-p", str(port), "ping"]


@pytest.mark.parametrize("name", ["default", "hostpath-nodeport"])
def test_bundled_redis_command_runs_real_redis(name: str, tmp_path: Path) -> None:
    """The Redis container's exact command line (persistence off and on) starts a real
    redis-server, and the container's probe command gets PONG from it."""
    (c,) = containers(workload_of(manifests(name), "redis"))
    args = list(c["args"])
    port = free_port()
    # Only where it listens and writes differ from the pod; every other flag is the chart's.
    args[args.index("--port") + 1] = str(port)
    args[args.index("--dir") + 1] = str(tmp_path)
    redis_server = shutil.which(c["command"][0])
    assert redis_server, "redis-server is not installed (make redis)"
    proc = subprocess.Popen(
        [redis_server, *args, "--bind", "127.0.0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        probe = c["readinessProbe"]["exec"]["command"]
        probe = [*probe[:2], str(port), *probe[3:]]

        def pong() -> bool:
            assert proc.poll() is None, f"redis-server exited: {proc.stdout.read()}"
            done = subprocess.run(probe, capture_output=True, text=True, timeout=10)
            return done.stdout.strip() == "PONG"

        wait_until(pong, 30, "the readiness probe's PONG", error=AssertionError)
        persistence = name == "hostpath-nodeport"
        config = subprocess.run(
            ["redis-cli", "-p", str(port), "config", "get", "appendonly"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split()
        assert config == ["appendonly", "yes" if persistence else "no"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()


# ---- wiring: GPUs, env, addresses, volumes -------------------------------------------


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_gpu_only_on_prefill_and_decode(chart: Any, name: str) -> None:
    docs = manifests(name)
    values = chart.merge_values(VALUE_SETS[name])
    for w in workloads(docs):
        role = component(w)
        for c in containers(w):
            resources = c.get("resources", {})
            gpu = {k: resources.get(k, {}).get("nvidia.com/gpu") for k in ("requests", "limits")}
            flags = flag_values(c) if c["command"][0] == "tandem" else {}
            if role in ENGINE_ROLES and values[role]["gpus"] > 0:
                want = values[role]["gpus"]
                assert gpu == {"requests": want, "limits": want}, (role, gpu)
                assert flags["--device"] == "cuda"
                tp, pp = int(flags["--tensor-parallel-size"]), int(flags["--pipeline-parallel-size"])
                assert (tp, pp) == (values[role]["tensorParallelSize"],
                                    values[role]["pipelineParallelSize"])
                assert tp * pp == want, (role, tp, pp, want)
                assert (flags.get("--enable-expert-parallel") == "true") == bool(
                    values[role]["enableExpertParallel"]), role
            else:
                assert gpu == {"requests": None, "limits": None}, (role, gpu)
                if role in ENGINE_ROLES:
                    assert flags["--device"] == "cpu"


def test_no_gpu_keeps_other_resources() -> None:
    """Adding the GPU entry must not clobber the role's own memory limit (merge order)."""
    for name in ("default", "no-gpu"):
        for role in ENGINE_ROLES:
            (c,) = containers(workload_of(manifests(name), role))
            assert c["resources"]["limits"]["memory"] == "32Gi"
            assert c["resources"]["requests"]["memory"] == "16Gi"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_arg_env_references_resolve(name: str) -> None:
    """Every $(VAR) in args is defined by the container's env or its envFrom ConfigMap:
    Kubernetes leaves an undefined reference as the literal text."""
    docs = manifests(name)
    configmaps = by_kind(docs, "ConfigMap")
    for w in workloads(docs):
        for c in containers(w):
            defined = {e["name"] for e in c.get("env", [])}
            for source in c.get("envFrom", []):
                defined |= set(configmaps[source["configMapRef"]["name"]]["data"])
            for arg in c.get("args", []) + c.get("command", []):
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert var in defined, f"{w['metadata']['name']}: $({var}) undefined"


def test_redis_url_points_at_bundled_redis_service() -> None:
    docs = manifests("default")
    services = by_kind(docs, "Service")
    for _, c in tandem_containers(docs):
        assert flag_values(c)["--redis-url"] == "$(TANDEM_REDIS_URL)"
        url = env_value(docs, c, "TANDEM_REDIS_URL")
        match = re.fullmatch(r"redis://([^:/]+):(\d+)/(\d+)", url)
        assert match, url
        service = services[match.group(1)]
        assert component(service) == "redis"
        assert int(match.group(2)) in {p["port"] for p in service["spec"]["ports"]}


def test_external_redis() -> None:
    docs = manifests("external-redis")
    assert all(component(w) != "redis" for w in workloads(docs))
    assert all(component(s) != "redis" for s in by_kind(docs, "Service").values())
    for _, c in tandem_containers(docs):
        assert env_value(docs, c, "TANDEM_REDIS_URL") == "redis://redis.infra.svc:6380/2"
    docs = manifests("external-redis-secret")
    for _, c in tandem_containers(docs):
        ref = env_value(docs, c, "TANDEM_REDIS_URL")
        assert ref == {"secretKeyRef": {"name": "redis-cred", "key": "redis-url"}}


def test_replica_counts() -> None:
    docs = manifests("3-prefill-5-decode")
    assert workload_of(docs, "prefill")["spec"]["replicas"] == 3
    assert workload_of(docs, "decode")["spec"]["replicas"] == 5
    assert workload_of(docs, "router")["spec"]["replicas"] == 1


def test_engine_flags_mirror_values() -> None:
    docs = manifests("production")
    prefill = flag_values(containers(workload_of(docs, "prefill"))[0])
    decode = flag_values(containers(workload_of(docs, "decode"))[0])
    assert prefill["--model"] == decode["--model"] == "/models/llama"
    assert prefill["--dtype"] == decode["--dtype"] == "bfloat16"
    assert prefill["--model-impl"] == decode["--model-impl"] == "transformers"
    assert prefill["--quantization"] == decode["--quantization"] == "int8"
    assert prefill["--block-size"] == decode["--block-size"] == "32"
    assert prefill["--max-model-len"] == "32768"
    assert prefill["--kv-cache-memory"] == str(40 * 2**30)  # no 4.29e+10 float formatting
    assert prefill["--max-num-batched-tokens"] == "16384"
    assert prefill["--max-num-seqs"] == "48"  # extraArgs come last and win
    assert "--kv-cache-memory" not in decode  # null leaves the service's default
    assert prefill["--gpu-memory-utilization"] == "0.85"
    assert "--gpu-memory-utilization" not in decode
    router = flag_values(containers(workload_of(docs, "router"))[0])
    assert router["--served-model-name"] == "llama-3.1-8b"
    assert router["--api-key"] == "$(TANDEM_API_KEY)"
    kvstore = flag_values(containers(workload_of(docs, "kvstore"))[0])
    assert kvstore["--capacity"] == str(64 * 2**30)
    # decode.speculative -> --speculative-config, on the decode pods only.
    from tandem.engine.config import SpeculativeConfig

    spec = SpeculativeConfig.from_json(decode["--speculative-config"])
    assert spec == SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)
    assert "--speculative-config" not in prefill
    default = flag_values(containers(workload_of(manifests("default"), "decode"))[0])
    assert "--speculative-config" not in default


@pytest.mark.parametrize("name", ["default", "hostpath-nodeport", "production"])
def test_engines_reach_the_kvstore(name: str) -> None:
    docs = manifests(name)
    store = workload_of(docs, "kvstore")
    (store_c,) = containers(store)
    store_port = host_port(flag_values(store_c)["--listen"])[1]
    for role in ENGINE_ROLES:
        (c,) = containers(workload_of(docs, role))
        host, port = host_port(flag_values(c)["--kvstore"])
        assert port == store_port
        if store["kind"] == "DaemonSet":
            # The store on the pod's own node, through the hostPort.
            assert host == "$(TANDEM_HOST_IP)"
            (ucx,) = [p for p in store_c["ports"] if p["name"] == "ucx"]
            assert ucx["hostPort"] == store_port
        else:
            service = by_kind(docs, "Service")[host]
            assert component(service) == "kvstore"
            assert "clusterIP" not in service["spec"]  # load-balanced, not headless
            assert store_port in {p["port"] for p in service["spec"]["ports"]}


@pytest.mark.parametrize("name", ["production", "hostpath-nodeport"])
def test_model_volume_mounted_read_only_at_model_path(chart: Any, name: str) -> None:
    docs = manifests(name)
    model = chart.merge_values(VALUE_SETS[name])["model"]
    for role in ("router", "prefill", "decode"):
        w = workload_of(docs, role)
        (c,) = containers(w)
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "model"]
        assert mount["mountPath"] == model["path"] and mount["readOnly"] is True
        assert flag_values(c)["--model"] == model["path"]
        (volume,) = [v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == "model"]
        if model["source"] == "pvc":
            assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
            assert mount["subPath"] == model["pvc"]["subPath"]
        else:
            assert volume["hostPath"]["path"] == model["hostPath"]["path"]
    # The store does not read weights.
    (c,) = containers(workload_of(docs, "kvstore"))
    assert all(m["name"] != "model" for m in c.get("volumeMounts", []))


def test_ucx_env_reaches_store_and_engines(chart: Any) -> None:
    docs = manifests("default")
    ucx = chart.values["ucx"]["env"]
    assert ucx
    for role, c in tandem_containers(docs):
        if role == "router":
            continue
        for var, value in ucx.items():
            assert env_value(docs, c, var) == str(value)


def test_ucx_env_parsed_by_real_ucx() -> None:
    """UCX ignores a misspelt variable (with only a warning) and rejects a bad value at run
    time; `ucx_info -c` from the project's own UCX build (the libucx wheel that ucxx loads)
    parses the chart's UCX_* settings exactly as the services will."""
    spec = importlib.util.find_spec("libucx")
    assert spec and spec.origin, "libucx (the [ucx] extra) is not installed"
    libucx = Path(spec.origin).parent
    docs = manifests("default")
    (config,) = by_kind(docs, "ConfigMap").values()
    ucx = {k: v for k, v in config["data"].items() if k.startswith("UCX_")}
    assert ucx
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(libucx / "lib"), **ucx}
    proc = subprocess.run(
        [str(libucx / "bin" / "ucx_info"), "-c"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ERROR" not in out.replace("_ERROR", ""), out[-2000:]
    parsed = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    for name, value in ucx.items():
        assert parsed.get(name) == value, f"UCX did not take {name}={value}: {parsed.get(name)}"


# ---- wiring: selectors ---------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_selectors_match_labels(name: str) -> None:
    docs = manifests(name)
    pods = workloads(docs)
    for w in pods:
        selector = w["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod_labels(w).items(), w["metadata"]["name"]
        # No workload's selector catches another component's pods.
        others = [o for o in pods if o is not w and selector.items() <= pod_labels(o).items()]
        assert others == [], w["metadata"]["name"]
    for svc in by_kind(docs, "Service").values():
        selected = [w for w in pods if svc["spec"]["selector"].items() <= pod_labels(w).items()]
        assert len(selected) == 1, svc["metadata"]["name"]
        names, numbers = set(), set()
        for c in containers(selected[0]):
            n, p = container_ports(c)
            names |= n
            numbers |= p
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in names | numbers, (svc["metadata"]["name"], target)
    for pdb in by_kind(docs, "PodDisruptionBudget").values():
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert sum(selector.items() <= pod_labels(w).items() for w in pods) == 1
    deployments = by_kind(docs, "Deployment")
    for hpa in by_kind(docs, "HorizontalPodAutoscaler").values():
        target = deployments[hpa["spec"]["scaleTargetRef"]["name"]]
        assert "replicas" not in target["spec"]  # the HPA owns the count
    for ing in by_kind(docs, "Ingress").values():
        for rule in ing["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                svc = by_kind(docs, "Service")[backend["name"]]
                assert backend["port"]["name"] in {p["name"] for p in svc["spec"]["ports"]}
    for sts in by_kind(docs, "StatefulSet").values():
        governing = by_kind(docs, "Service")[sts["spec"]["serviceName"]]
        assert governing["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("name", ["default", "hostpath-nodeport"])
def test_pods_use_the_service_account(name: str) -> None:
    docs = manifests(name)
    accounts = set(by_kind(docs, "ServiceAccount"))
    for role, _ in tandem_containers(docs):
        pod = workload_of(docs, role)["spec"]["template"]["spec"]
        if name == "default":
            assert pod["serviceAccountName"] in accounts
        else:
            assert accounts == set()
            assert pod["serviceAccountName"] == "llm-runner"
        assert pod["automountServiceAccountToken"] is False  # no pod calls the API server


def test_kvstore_memory_covers_its_pool() -> None:
    (c,) = containers(workload_of(manifests("default"), "kvstore"))
    capacity = int(flag_values(c)["--capacity"])
    assert c["resources"]["limits"]["memory"] == c["resources"]["requests"]["memory"]
    assert c["resources"]["limits"]["memory"] > capacity
    (c,) = containers(workload_of(manifests("hostpath-nodeport"), "kvstore"))
    assert c["resources"]["limits"]["memory"] == "12Gi"  # the user's limit wins


def test_service_monitor_scrapes_every_metrics_endpoint() -> None:
    docs = manifests("production")
    (monitor,) = by_kind(docs, "ServiceMonitor").values()
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = [
        s
        for s in by_kind(docs, "Service").values()
        if selector.items() <= s["metadata"]["labels"].items()
    ]
    assert {component(s) for s in scraped} == set(TANDEM_ROLES)
    endpoint_ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    for svc in scraped:
        ports = {p["name"] for p in svc["spec"]["ports"]} & endpoint_ports
        assert len(ports) == 1, (svc["metadata"]["name"], ports)  # scraped once, not twice
        (port,) = ports
        # That Service port leads to the process's metrics (router: its HTTP port).
        w = workload_of(docs, component(svc))
        (c,) = containers(w)
        listens = listen_port(component(svc), flag_values(c))
        (svc_port,) = [p for p in svc["spec"]["ports"] if p["name"] == port]
        assert (
            resolve_port(c, svc_port["targetPort"])
            == listens["http" if component(svc) == "router" else "metrics"]
        )


@pytest.mark.parametrize("name", ["default", "production"])
def test_helm_test_hook_calls_the_router(name: str) -> None:
    """`helm test`'s Pod runs valid Python against the router Service's HTTP port, with the
    API key when the router requires one."""
    docs = manifests(name)
    (pod,) = [d for d in by_kind(docs, "Pod").values()]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    compile(c["args"][0], "helm-test", "exec")  # raises SyntaxError on a broken script
    url = env_value(docs, c, "TANDEM_URL")
    match = re.fullmatch(r"http://([^:/]+):(\d+)", url)
    assert match, url
    service = by_kind(docs, "Service")[match.group(1)]
    assert component(service) == "router"
    (http,) = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    assert int(match.group(2)) == http["port"]
    has_key = any(e["name"] == "TANDEM_API_KEY" for e in c.get("env", []))
    assert has_key == (name == "production")


def test_internal_tls_mounts_the_secret_and_passes_it_to_router_and_engines() -> None:
    """internalTLS: the router and both engine roles mount the secret read-only and name
    its files in --tls-cert/--tls-key/--tls-ca; the router checks the engines' certificate
    against internalTLS.serverName; without it, no TLS flag and no such volume."""
    tls_dir = "/etc/tandem/tls"
    want = {"--tls-cert": f"{tls_dir}/tls.crt", "--tls-key": f"{tls_dir}/tls.key",
            "--tls-ca": f"{tls_dir}/ca.crt"}
    docs = manifests("internal-tls")
    seen = set()
    for role, c in tandem_containers(docs):
        flags = flag_values(c)
        if role == "kvstore":
            assert "--tls-cert" not in flags
            continue
        seen.add(role)
        assert {k: flags.get(k) for k in want} == want, role
        mount = next(m for m in c["volumeMounts"] if m["name"] == "internal-tls")
        assert mount == {"name": "internal-tls", "mountPath": tls_dir, "readOnly": True}
        if role == "router":
            assert flags["--tls-server-name"] == "tandem-engine"
    assert seen == {"router", "prefill", "decode"}
    for doc in docs:
        if doc["kind"] == "Deployment":
            vols = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
            assert vols["internal-tls"]["secret"]["secretName"] == "tandem-internal-tls"
    for role, c in tandem_containers(manifests("default")):
        assert not any(k.startswith("--tls") for k in flag_values(c)), role
