"""The generated KubeRay manifests (k8s/*.yaml): valid for the RayService CRD, true to the Serve configs."""

from __future__ import annotations

import copy
import json
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from core.config import AppConfig
from serve_app import manifests

REPO = Path(__file__).resolve().parents[3]
CRD_PATH = REPO.parent / "shared" / "kuberay" / "ray.io_rayservices.yaml"
MANIFESTS = sorted((REPO / "k8s").glob("*.yaml"))
ROLES = ("prefill", "decode", "speech", "tts")  # (speech: the GPU configs name a Whisper model; tts: espeak-ng)
CPU_ROLES = ("tts",)  # pods without a GPU
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@cache
def crd() -> dict[str, Any]:
    if not CRD_PATH.is_file():
        pytest.fail(
            f"the RayService CRD schema is missing: expected {CRD_PATH} (the shared/ folder beside the repo, "
            "with kuberay/ray.io_rayservices.yaml from ray-project/kuberay)"
        )
    return yaml.load(CRD_PATH.read_text(), Loader=Loader)


def _k8s_to_jsonschema(node: Any) -> Any:
    """The CRD's OpenAPI v3 schema as plain JSON Schema, as strict as the API server's field validation.

    - `x-kubernetes-int-or-string: true`: an integer or a string (made explicit, whether or not the node
      already spells it out with anyOf);
    - objects with `properties` and no `additionalProperties`: unknown fields are errors (kubectl's default
      strict field validation), unless `x-kubernetes-preserve-unknown-fields` says otherwise.
    """
    if isinstance(node, list):
        return [_k8s_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _k8s_to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@cache
def validator(api_version: str) -> jsonschema.protocols.Validator:
    group, version = api_version.split("/")
    spec = crd()["spec"]
    assert spec["group"] == group, f"{api_version}: the CRD is for group {spec['group']}"
    (entry,) = [v for v in spec["versions"] if v["name"] == version]
    schema = _k8s_to_jsonschema(entry["schema"]["openAPIV3Schema"])
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    cls.check_schema(schema)
    return cls(schema)


def documents(path: Path) -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.load_all(path.read_text(), Loader=Loader) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), f"{path.name}: one document per kind expected"
    return by_kind


def deployment(args: dict[str, Any], role: str) -> dict[str, Any]:
    return args.get(role, {}).get("deployment", {})


def needs(dep: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """GPUs and custom resources one replica of a deployment asks Ray for."""
    options = dep.get("ray_actor_options", {})
    custom = dict(options.get("resources", {}))
    bundles = dep.get("placement_group_bundles")
    if not bundles:
        return int(options.get("num_gpus", 0)), custom
    gpus = sum(b.get("GPU", 0) for b in bundles)
    for key, value in custom.items():  # the replica actor lives in bundle 0
        assert bundles[0].get(key, 0) >= value
    return int(gpus), custom


def parse_resources_param(value: str) -> dict[str, float]:
    assert value.startswith('"') and value.endswith('"'), value
    return json.loads(value[1:-1].replace('\\"', '"'))


def test_manifests_exist() -> None:
    configs = sorted((REPO / "configs" / "gpu").glob("*.yaml"))
    assert configs, "no GPU configs under configs/gpu"
    assert [p.stem for p in MANIFESTS if "RayService" in documents(p)] == [p.stem for p in configs]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_rayservice_matches_crd(path: Path) -> None:
    service = documents(path)["RayService"]
    errors = sorted(validator(service["apiVersion"]).iter_errors(service), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_crd_validation_is_strict() -> None:
    service = documents(MANIFESTS[0])["RayService"]
    bad = copy.deepcopy(service)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3  # typo
    assert not validator(bad["apiVersion"]).is_valid(bad)
    bad = copy.deepcopy(service)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "cpu"
    ] = 8.5  # neither an integer nor a quantity string
    assert not validator(bad["apiVersion"]).is_valid(bad)
    good = copy.deepcopy(service)
    good["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "cpu"
    ] = "8"  # int-or-string: a string passes too
    assert validator(good["apiVersion"]).is_valid(good)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_serve_config_is_the_config_file(path: Path) -> None:
    text = documents(path)["RayService"]["spec"]["serveConfigV2"]
    assert text == (REPO / "configs" / "gpu" / path.name).read_text()
    serve = ServeDeploySchema.model_validate(yaml.safe_load(text))
    for app in serve.applications:
        AppConfig.model_validate(app.args)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_pods_match_deployments(path: Path) -> None:
    docs = documents(path)
    spec = docs["RayService"]["spec"]
    (app,) = yaml.safe_load(spec["serveConfigV2"])["applications"]
    args = app["args"]
    cluster = spec["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert "autoscalerOptions" in cluster

    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    (head_container,) = head["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head_container["resources"].get("limits", {})
    assert {"cpu", "memory"} <= head_container["resources"]["requests"].keys()
    assert any(p["containerPort"] == 8000 for p in head_container["ports"])
    router = deployment(args, "router")
    router_gpus, router_custom = needs(router)
    assert router_gpus == 0
    if router_custom:
        head_custom = parse_resources_param(head["rayStartParams"]["resources"])
        n = router.get("autoscaling_config", {}).get("max_replicas") or router.get("num_replicas", 1)
        assert all(head_custom.get(k, 0) >= v * n for k, v in router_custom.items())

    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == set(ROLES)
    pools = []
    for role in ROLES:
        dep, group = deployment(args, role), groups[role]
        gpus, custom = needs(dep)
        (worker,) = group["template"]["spec"]["containers"]
        pod = group["template"]["spec"]
        if role in CPU_ROLES:
            assert gpus == 0 and "nvidia.com/gpu" not in worker["resources"]["limits"]
            assert "nodeSelector" not in pod and "tolerations" not in pod
        else:
            assert gpus >= 1
            assert worker["resources"]["limits"]["nvidia.com/gpu"] == gpus
            assert pod["nodeSelector"] and pod["tolerations"]
        assert parse_resources_param(group["rayStartParams"]["resources"]) == custom
        scaling = dep["autoscaling_config"]
        assert "num_replicas" not in dep
        assert (group["minReplicas"], group["maxReplicas"]) == (
            scaling["min_replicas"],
            scaling["max_replicas"],
        )
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        shm = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
        token = [e for e in worker["env"] if e["name"] == "HF_TOKEN"]
        assert token == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}]
        pools.append(set(custom))
    assert all(pools) and all(not a & b for i, a in enumerate(pools) for b in pools[i + 1 :]), (
        "each role needs a custom resource of its own"
    )

    assert docs["Secret"]["metadata"]["name"] == "hf-token" and "token" in docs["Secret"]["stringData"]
    svc = docs["Service"]["spec"]
    assert svc["type"] == "ClusterIP"
    assert svc["selector"]["ray.io/node-type"] == "head"
    assert [p["port"] for p in svc["ports"]] == [8000]
    head_labels = head["template"]["metadata"]["labels"]
    assert all(head_labels.get(k) == v for k, v in svc["selector"].items() if not k.startswith("ray.io/"))


def test_manifests_are_up_to_date() -> None:
    assert manifests.stale() == [], "k8s/ is stale: run `python -m serve_app.manifests`"
    assert manifests.main(["--check"]) == 0


def test_check_detects_drift(tmp_path: Path) -> None:
    configs, out = tmp_path / "configs", tmp_path / "k8s"
    configs.mkdir()
    shutil.copy(REPO / "configs" / "gpu" / "llama-3.1-8b.yaml", configs / "a.yaml")
    argv = ["--configs", str(configs), "--out", str(out)]
    assert manifests.main([*argv, "--check"]) == 1  # missing
    assert manifests.main(argv) == 0
    assert manifests.main([*argv, "--check"]) == 0
    (configs / "a.yaml").write_text((configs / "a.yaml").read_text().replace("max_replicas: 4", "max_replicas: 6"))
    assert manifests.main([*argv, "--check"]) == 1  # changed config
    assert manifests.main(argv) == 0
    (configs / "a.yaml").rename(configs / "b.yaml")
    assert manifests.main([*argv, "--check"]) == 1  # b missing, a orphaned
    assert manifests.main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["b.yaml"]
    assert manifests.main([*argv, "--image", "example.com/other:1", "--check"]) == 1


def test_names_are_dns_labels() -> None:
    # Services need DNS-1035 labels; KubeRay derives `<name>-serve-svc`, `<name>-head-svc`, ... from it.
    for path in MANIFESTS:
        for doc in documents(path).values():
            name = doc["metadata"]["name"]
            assert name[0].isalpha() and name.replace("-", "").isalnum() and name.islower(), name
            assert len(name) <= 40, name


def test_resources_param_format() -> None:
    # KubeRay's documented form: resources: '"{\"Custom1\": 1, \"Custom2\": 5}"'
    assert manifests.ray_resources_param({"Custom1": 1, "Custom2": 5}) == '"{\\"Custom1\\": 1, \\"Custom2\\": 5}"'
    assert parse_resources_param(manifests.ray_resources_param({"prefill_pool": 1})) == {"prefill_pool": 1}


def test_ray_version_matches_installed() -> None:
    from importlib.metadata import version

    assert version("ray") == manifests.RAY_VERSION
