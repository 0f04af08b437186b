"""The Kubernetes example (``examples/deploy/kubernetes``) cannot be applied here, but what it says
can be checked offline:

- every manifest, and every object of the GPU overlay rendered the way kustomize renders it (its
  image override and strategic merge patches), validates against the Kubernetes OpenAPI schemas
  that ``kubernetes-validate`` ships (strict: an unknown field is an error);
- every ``kvlease router`` flag in the manifests exists in the router's CLI, and the secrets reach
  the environment variables the router and the connector read;
- every ``--kv-transfer-config`` passes kvlease's own config validation, with the roles and the
  ``kv_buffer_device`` the design needs (``cuda`` on GPUs), and names a supported vLLM.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

kubernetes_validate = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")

from kvlease.protocol import CONTROL_SECRET_ENV  # noqa: E402
from kvlease_router import cli as router_cli  # noqa: E402
from kvlease_vllm._config import check_vllm_version, normalize_extra_config  # noqa: E402

from ._connector_start import check_connector_start  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "examples" / "deploy" / "kubernetes"
#: The Kubernetes version whose schemas the manifests must satisfy (the newest the package ships).
K8S_VERSION = kubernetes_validate.latest_version()
Obj = dict[str, Any]


def _docs(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomization(folder: Path) -> Obj:
    return dict(_docs(folder / "kustomization.yaml")[0])


def _merge(base: Any, patch: Any) -> Any:
    """Strategic merge as kustomize applies it to the fields these patches use: maps merge, lists of
    named maps (containers, env, ports, volumes) merge by ``name``, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and "name" in x for x in base + patch)
    ):
        merged = [copy.deepcopy(x) for x in base]
        for item in patch:
            at = next((i for i, x in enumerate(merged) if x["name"] == item["name"]), None)
            if at is None:
                merged.append(copy.deepcopy(item))
            else:
                merged[at] = _merge(merged[at], item)
        return merged
    return copy.deepcopy(patch)


def _containers(obj: Obj) -> list[Obj]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return list(spec.get("containers", []))


def render(folder: Path) -> list[Obj]:
    """The objects ``kubectl kustomize folder`` would output (for the features this example uses)."""
    k = _kustomization(folder)
    objs: list[Obj] = []
    for res in k.get("resources", []):
        path = folder / res
        objs += render(path) if path.is_dir() else _docs(path)
    for lab in k.get("labels", []):
        for obj in objs:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(lab["pairs"])
    for p in k.get("patches", []):
        patch = _docs(folder / p["path"])[0]
        hits = [
            i
            for i, o in enumerate(objs)
            if (o["kind"], o["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])
        ]
        assert len(hits) == 1, f"patch {p['path']} matches {len(hits)} objects"
        objs[hits[0]] = _merge(objs[hits[0]], patch)
    for img in k.get("images", []):
        for obj in objs:
            for c in _containers(obj):
                name, _, tag = c["image"].partition(":")
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag)}"
    return objs


def _find(objs: list[Obj], kind: str, name: str) -> Obj:
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


MANIFESTS = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")
PATCHES = {K8S / "gpu" / p["path"] for p in _kustomization(K8S / "gpu").get("patches", [])}
LAYERS = ["base", "gpu"]


@pytest.mark.parametrize("path", [p for p in MANIFESTS if p not in PATCHES], ids=lambda p: p.name)
def test_every_manifest_validates_against_the_kubernetes_schemas(path: Path) -> None:
    for obj in _docs(path):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("layer", LAYERS)
def test_every_rendered_object_validates(layer: str) -> None:
    objs = render(K8S / layer)
    kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objs)
    assert kinds == [
        "ConfigMap/kvlease-model",
        "Deployment/kvlease-decode",
        "Deployment/kvlease-prefill",
        "Deployment/kvlease-redis",
        "Deployment/kvlease-router",
        "Secret/kvlease-control-secret",
        "Secret/kvlease-key-secret",
        "Service/kvlease-decode",
        "Service/kvlease-prefill",
        "Service/kvlease-redis",
        "Service/kvlease-router",
    ]
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_validator_rejects_a_misspelt_field() -> None:
    """The schemas are really applied (offline): a typo in a probe is an error, not ignored."""
    obj = _find(render(K8S / "gpu"), "Deployment", "kvlease-router")
    c = obj["spec"]["template"]["spec"]["containers"][0]
    c["readinesProbe"] = c.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _router_flags() -> set[str]:
    import typer
    from typer.main import get_command

    t = typer.Typer()
    t.command()(router_cli.app)
    return {opt for p in get_command(t).params for opt in (*p.opts, *p.secondary_opts)}


def _env(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("layer", LAYERS)
def test_router_runs_as_replicas_with_flags_the_cli_has(layer: str) -> None:
    objs = render(K8S / layer)
    router = _find(objs, "Deployment", "kvlease-router")
    assert router["spec"]["replicas"] >= 2
    (c,) = _containers(router)
    assert c["command"] == ["kvlease", "router"]
    flags = [a.split("=", 1)[0] for a in c["args"] if a.startswith("--")]
    assert flags and set(flags) <= _router_flags(), sorted(set(flags) - _router_flags())
    args = dict(a.split("=", 1) for a in c["args"] if "=" in a)
    assert args["--state"].startswith("redis://kvlease-redis:")
    # every node URL is a Service of this example, on the port its container listens on
    for flag, name, port in [
        ("--prefill", "kvlease-prefill", "http"),
        ("--prefill-control", "kvlease-prefill", "control"),
        ("--decode", "kvlease-decode", "http"),
        ("--decode-control", "kvlease-decode", "control"),
    ]:
        svc = _find(objs, "Service", name)
        (svc_port,) = [p["port"] for p in svc["spec"]["ports"] if p["name"] == port]
        assert args[flag] == f"http://{name}:{svc_port}"
    env = _env(c)
    assert env[CONTROL_SECRET_ENV]["valueFrom"]["secretKeyRef"]["name"] == "kvlease-control-secret"
    assert env[router_cli.KEY_SECRET_ENV]["valueFrom"]["secretKeyRef"]["name"] == "kvlease-key-secret"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"


def _kv_config(container: Obj) -> Obj:
    args = container["args"]
    raw = args[args.index("--kv-transfer-config") + 1].replace("$(POD_IP)", "10.0.0.5")
    return dict(json.loads(raw))


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize(
    ("name", "role"), [("kvlease-prefill", "kv_producer"), ("kvlease-decode", "kv_consumer")]
)
def test_vllm_nodes_carry_a_valid_kvlease_config(layer: str, name: str, role: str) -> None:
    objs = render(K8S / layer)
    dep = _find(objs, "Deployment", name)
    assert dep["spec"]["replicas"] == 1  # the router addresses each node on its own
    (c,) = _containers(dep)
    assert c["command"] == ["vllm", "serve"] and c["args"][0] == "$(MODEL)"
    kv = _kv_config(c)
    assert kv["kv_connector"] == "KVLeaseConnector"
    assert kv["kv_connector_module_path"] == "kvlease_vllm.connector"
    assert kv["kv_role"] == role
    assert kv["kv_buffer_device"] == ("cuda" if layer == "gpu" else "cpu")
    assert (kv.get("kv_load_failure_policy") == "recompute") == (role == "kv_producer")
    extra = kv["kv_connector_extra_config"]
    assert extra["bidirectional_kv_xfer"] is True  # identical on both nodes
    cfg, warnings = normalize_extra_config(extra)  # unknown or mistyped keys would raise
    assert warnings == [] and cfg.control_advertise_host == "10.0.0.5"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert cfg.control_port == ports["control"] and f"--port={ports['http']}" in c["args"]
    env = _env(c)
    assert env[CONTROL_SECRET_ENV]["valueFrom"]["secretKeyRef"]["name"] == "kvlease-control-secret"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)"
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"]) == ports["nixl"]
    assert env["MODEL"]["valueFrom"]["configMapKeyRef"]["name"] == "kvlease-model"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    version = re.search(r"vllm(\d+\.\d+\.\d+)", c["image"])
    assert version, c["image"]
    check_vllm_version(version.group(1))  # an image the connector refuses would fail at start
    if layer == "gpu":
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"]["value"] == "on"
        assert c["image"].endswith("-cuda")
    # what the connector checks at start: GPU vLLM 0.33 schedules asynchronously unless told not to
    # (vLLM's CPU build never does)
    async_scheduling = layer == "gpu" and "--no-async-scheduling" not in c["args"]
    util: float | None = None
    if layer == "gpu":
        flags = dict(a.split("=", 1) for a in c["args"] if a.startswith("--") and "=" in a)
        util = float(flags["--gpu-memory-utilization"])
    check_connector_start(role, extra, cfg, async_scheduling=async_scheduling, gpu_memory_utilization=util)


def test_prefill_and_decode_agree() -> None:
    """What must match on P and D (README): model, vLLM, bidirectional transfer, TTL, backend."""
    for layer in LAYERS:
        objs = render(K8S / layer)
        p, d = (_containers(_find(objs, "Deployment", n))[0] for n in ("kvlease-prefill", "kvlease-decode"))
        assert p["image"] == d["image"]
        pe, de = _kv_config(p)["kv_connector_extra_config"], _kv_config(d)["kv_connector_extra_config"]
        for key in ("bidirectional_kv_xfer", "decoder_kv_blocks_ttl", "backends", "kv_recompute_threshold"):
            assert pe[key] == de[key], key
