"""deploy/kubernetes, rendered the way `kubectl apply -k` renders it and checked offline: every
resource against the Kubernetes API schemas (the `kubernetes-validate` package ships them;
strict: an unknown field fails too), and against what the code expects of it: the commands
parse with microserve's own command line, the router follows each role's headless Service, the
strategy file loads, the tokens come from the Secret under the names the code reads.

The kustomization is kept to what render() implements (namespace, images, resources); any other
key fails the test rather than being silently ignored. Where kubectl is installed, its own
rendering (`kubectl kustomize`) must equal ours.
"""

from __future__ import annotations

import asyncio
import shlex
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from launcher.cli import parser
from router.engines import EnginePool
from router.host import StrategyHost, StrategySource

KUSTOMIZE_DIR = Path(__file__).parent.parent / "deploy" / "kubernetes"
# The oldest Kubernetes minor still supported upstream when this was written, and the newest
# the package knows.
VERSIONS = ("1.31", kubernetes_validate.latest_version())
RENDERED_KEYS = {"apiVersion", "kind", "namespace", "images", "resources"}
CLUSTER_SCOPED = {"Namespace"}
ROLES = ("prefill", "decode", "any")
POD_IP = "10.244.1.7"  # stands for $(POD_IP) / ${POD_IP} when commands are parsed


def render(directory: Path) -> list[dict]:
    """What `kubectl apply -k directory` applies, for the keys in RENDERED_KEYS."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - RENDERED_KEYS
    assert not unknown, f"kustomization keys this test does not render: {unknown}"
    images = {i["name"]: i for i in kustomization.get("images", [])}
    docs = []
    for resource in kustomization["resources"]:
        for doc in yaml.safe_load_all((directory / resource).read_text()):
            if doc is None:
                continue
            if doc["kind"] not in CLUSTER_SCOPED and "namespace" in kustomization:
                doc["metadata"]["namespace"] = kustomization["namespace"]
            for container in _containers(doc):
                name, _, tag = container["image"].partition(":")
                if name in images:
                    new = images[name]
                    container["image"] = (f"{new.get('newName', name)}:"
                                          f"{new.get('newTag', tag or 'latest')}")
            docs.append(doc)
    return docs


def render_overlay(directory: Path) -> list[dict]:
    """What `kubectl apply -k directory` applies for an overlay of one base directory whose
    patches are JSON 6902 `add` and `replace` operations on targets chosen by kind and one
    label (deploy/kubernetes-tp2); any other key or operation fails the test."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {"apiVersion", "kind", "resources", "patches"}
    assert not unknown, f"kustomization keys this test does not render: {unknown}"
    [base] = kustomization["resources"]
    docs = render((directory / base).resolve())
    for patch in kustomization["patches"]:
        target = patch["target"]
        assert set(target) <= {"kind", "labelSelector"}, target
        label, _, value = target.get("labelSelector", "=").partition("=")
        for doc in docs:
            if doc["kind"] != target["kind"] or (
                    label and doc["metadata"].get("labels", {}).get(label) != value):
                continue
            for op in yaml.safe_load(patch["patch"]):
                *parents, last = [p.replace("~1", "/").replace("~0", "~")
                                  for p in op["path"].split("/")[1:]]
                node = doc
                for key in parents:
                    node = node[int(key)] if isinstance(node, list) else node[key]
                if op["op"] == "add" and last == "-":
                    node.append(op["value"])
                elif op["op"] == "replace":
                    assert last in node, op["path"]
                    node[last] = op["value"]
                else:
                    raise AssertionError(f"operation this test does not apply: {op}")
    return docs


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return render(KUSTOMIZE_DIR)


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_every_manifest_is_valid_against_the_kubernetes_schemas(docs):
    assert {(d["kind"], d["metadata"]["name"]) for d in docs} == {
        ("Namespace", "microserve"), ("ConfigMap", "microserve-strategy"),
        ("Deployment", "microserve-router"), ("Service", "microserve-router"),
        *((kind, f"microserve-{role}") for kind in ("Deployment", "Service") for role in ROLES)}
    for doc in docs:
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises what is wrong
    assert all(d["metadata"].get("namespace") == "microserve" for d in docs
               if d["kind"] != "Namespace")


def test_the_validation_catches_a_broken_manifest(docs):
    broken = yaml.safe_load(yaml.safe_dump(by_kind(docs, "Deployment")["microserve-decode"]))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    with pytest.raises(kubernetes_validate.ValidationError, match="is not of type 'integer'"):
        kubernetes_validate.validate(broken, VERSIONS[0], strict=True)
    broken = yaml.safe_load(yaml.safe_dump(by_kind(docs, "Service")["microserve-decode"]))
    broken["spec"]["clusterIp"] = "None"  # a misspelled field: strict refuses it
    with pytest.raises(kubernetes_validate.ValidationError, match="clusterIp"):
        kubernetes_validate.validate(broken, VERSIONS[0], strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kubectl_renders_the_same(docs):
    out = subprocess.run(["kubectl", "kustomize", str(KUSTOMIZE_DIR)], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    theirs = [d for d in yaml.safe_load_all(out) if d is not None]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(theirs, key=key) == sorted(docs, key=key)


def _command(container: dict) -> list[str]:
    argv = container["command"] + container.get("args", [])
    return [a.replace("$(POD_IP)", POD_IP) for a in argv]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e.get("valueFrom") or {"value": e.get("value")}
            for e in container.get("env", [])}


def _secret(key: str, optional: bool = False) -> dict:
    ref = {"name": "microserve-secrets", "key": key}
    return {"secretKeyRef": {**ref, "optional": True} if optional else ref}


def test_engines_one_workload_per_role_with_probes_drain_and_transfer_port(docs):
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    router_service = services["microserve-router"]
    router_port = router_service["spec"]["ports"][0]["port"]
    router_url = f"http://{router_service['metadata']['name']}:{router_port}"
    for role in ROLES:
        pod = deployments[f"microserve-{role}"]["spec"]["template"]
        [engine] = pod["spec"]["containers"]
        args = parser().parse_args(_command(engine)[1:])
        assert (args.command, args.host, args.port, args.kv_transfer, args.kv_transfer_port,
                args.kv_transfer_advertise_host, args.deployment) == (
            "engine", "0.0.0.0", 8000, "tcp", 9000, POD_IP, "microserve")
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
        ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
        assert ports == {"http": 8000, "kv-transfer": 9000}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert engine[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
        env = _env(engine)
        assert env["MICROSERVE_API_KEY"] == _secret("engine-api-key")
        assert env["MICROSERVE_ADMIN_TOKEN"] == _secret("admin-token")
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        # preStop: `microserve drain` of this pod's engine at the router's Service.
        shell = engine["lifecycle"]["preStop"]["exec"]["command"]
        assert shell[:2] == ["sh", "-c"]
        drain = shlex.split(shell[2].replace("${POD_IP}", POD_IP))
        assert drain[:2] == ["exec", "microserve"]
        args = parser().parse_args(drain[2:])
        assert (args.command, args.router, args.engine) == (
            "drain", router_url, f"http://{POD_IP}:8000")
        assert pod["spec"]["terminationGracePeriodSeconds"] > args.wait_s
        # Its headless Service selects exactly these pods.
        service = services[f"microserve-{role}"]["spec"]
        assert service["clusterIP"] == "None"
        assert service["selector"].items() <= pod["metadata"]["labels"].items()
        assert service["selector"]["microserve/role"] == role
        assert {p["name"]: p["port"] for p in service["ports"]} == ports


def test_the_router_follows_each_role_and_hot_swaps_the_configmap_strategy(docs):
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    pod = deployments["microserve-router"]["spec"]["template"]["spec"]
    [router] = pod["containers"]
    args = parser().parse_args(_command(router)[1:])
    assert args.command == "router" and args.watch_strategy
    assert args.deployment == "microserve"
    assert {(n.name, n.port, n.role) for n in args.engines_from_dns} == {
        (f"microserve-{role}", 8000, role) for role in ROLES}
    assert args.engine == []
    assert _env(router)["MICROSERVE_ADMIN_TOKEN"] == _secret("admin-token")
    assert _env(router)["MICROSERVE_ENGINE_API_KEY"] == _secret("engine-api-key")
    assert _env(router)["MICROSERVE_API_KEY"] == _secret("api-key", optional=True)
    assert services["microserve-router"]["spec"]["selector"].items() <= deployments[
        "microserve-router"]["spec"]["template"]["metadata"]["labels"].items()
    # The strategy file is the ConfigMap's, mounted as a directory (a subPath mount would
    # never see an edit).
    path = Path(args.strategy)
    [mount] = [m for m in router["volumeMounts"] if m["mountPath"] == str(path.parent)]
    assert "subPath" not in mount
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    configmap = by_kind(docs, "ConfigMap")[volume["configMap"]["name"]]
    source = configmap["data"][path.name]

    async def load():
        host = StrategyHost(EnginePool())
        try:
            return await host.load(StrategySource.upload(source, path.name))
        finally:
            await host.close()

    assert asyncio.run(load()).name == "Serving"


OVERLAY_TP2 = Path(__file__).parent.parent / "deploy" / "kubernetes-tp2"


def test_the_tensor_parallel_overlay_gives_each_engine_two_gpus_and_two_ranks(docs):
    """deploy/kubernetes-tp2: the base's resources, each engine's command with
    --tensor-parallel-size=2 and its container asking for two GPUs; nothing else differs, the
    result passes the schemas, and kubectl (where installed) renders the same."""
    tp2 = render_overlay(OVERLAY_TP2)
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, tp2)) == sorted(map(key, docs))
    base = {key(d): d for d in docs}
    for doc in tp2:
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
        if doc["kind"] != "Deployment" or doc["metadata"]["name"] == "microserve-router":
            assert doc == base[key(doc)]
            continue
        [engine] = doc["spec"]["template"]["spec"]["containers"]
        args = parser().parse_args(_command(engine)[1:])
        assert (args.command, args.tensor_parallel_size, args.kv_transfer) == ("engine", 2, "tcp")
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == 2
        [was] = base[key(doc)]["spec"]["template"]["spec"]["containers"]
        assert engine["args"] == was["args"] + ["--tensor-parallel-size=2"]
        assert {**engine, "args": was["args"], "resources": was["resources"]} == was
    if shutil.which("kubectl") is not None:
        out = subprocess.run(["kubectl", "kustomize", str(OVERLAY_TP2)], capture_output=True,
                             text=True, timeout=60, check=True).stdout
        theirs = [d for d in yaml.safe_load_all(out) if d is not None]
        assert sorted(theirs, key=key) == sorted(tp2, key=key)
