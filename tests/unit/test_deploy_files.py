"""The deploy files agree with the code: the dashboard and alert rules ask only for metrics the
worker exports, and the gateways' image, compose services and Kubernetes objects run the real
commands on their real ports, with probes on paths they answer."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import typer
import yaml
from prometheus_client import generate_latest
from pydantic_settings import BaseSettings
from redis.exceptions import ConnectionError as RedisConnectionError
from typer.core import TyperGroup
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

import exlq.cli  # noqa: F401 (it adds the worker's and the gateways' commands to the app)
from exlq.ops.exporter import QueueCollector
from exlq.producer.cli import app as exlq_app
from exlq.producer.gateways.exllamav2_ws import server as ws_server
from exlq.producer.gateways.openai_api import app as openai_app
from exlq.producer.gateways.openai_api.auth import load_keys
from exlq.producer.gateways.openai_api.batch_settings import BatchSettings
from exlq.producer.gateways.openai_api.settings import GatewaySettings
from exlq.protocol.redis_credentials import RedisCredentials
from exlq.worker.metrics import Metrics
from tests.monitoring import family, names_used

ROOT = Path(__file__).resolve().parents[2]


def exported_names() -> set[str]:
    metrics = Metrics("q", "m")
    metrics.info("v", "echo", {})
    metrics.job_completed("stop")
    metrics.job_failed("engine_error")
    text = generate_latest(metrics.registry).decode()
    return {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def exporter_names() -> set[str]:
    """The families `exlq exporter` serves (here from a collection that read no queue)."""
    return {f.name for f in QueueCollector(lambda _timeout: [], 1.0).collect()}


def test_dashboard_and_alerts_use_exported_metrics() -> None:
    """Every exlq metric a panel, a template variable or an alert asks for is one the worker
    or the exporter exports: a renamed metric leaves no panel silently empty. (The same
    check against live scrapes: tests/integration/test_monitoring_live.py.)"""
    exported = {family(n) for n in exported_names() | exporter_names()}
    asked = names_used()
    assert asked, "no exlq metrics found in the dashboard or rules"
    assert asked <= exported, f"not exported: {sorted(asked - exported)}"


def test_counters_end_in_total_and_carry_no_job_ids() -> None:
    names = exported_names()
    assert "exlq_jobs_received_total" in names
    assert "exlq_time_to_first_token_seconds_bucket" in names
    text = generate_latest(Metrics("q").registry).decode()
    assert "job_id" not in text and 'id="' not in text


def _known_variables() -> set[str]:
    """Every EXLQ_* variable a worker reads: its settings' groups and each engine's."""
    from exlq.worker.engines.base import EngineUnavailable
    from exlq.worker.engines.registry import BUILTIN, find
    from exlq.worker.limits import RequestLimits
    from exlq.worker.settings import BrokerSettings, ServingSettings

    groups: list[type] = [BrokerSettings, ServingSettings, RequestLimits]
    for name in BUILTIN:
        try:
            groups.append(find(name).settings)
        except EngineUnavailable:  # an engine whose package is not installed here
            continue
    return {
        f"{group.model_config['env_prefix']}{field}".upper()  # type: ignore[attr-defined]
        for group in groups
        for field in group.model_fields  # type: ignore[attr-defined]
    }


def test_deploy_files_set_only_variables_a_worker_reads() -> None:
    known = _known_variables()
    configmap = yaml.safe_load((ROOT / "deploy/kubernetes/configmap.yaml").read_text())
    compose = yaml.safe_load((ROOT / "deploy/docker-compose.yml").read_text())
    gateway_services = {g.service for g in GATEWAYS}
    given = {name for name in configmap["data"] if name.startswith("EXLQ_")}
    for name, service in compose["services"].items():
        if name in gateway_services:  # a gateway's are checked against the gateway's
            continue
        environment = service.get("environment") or {}
        given |= {name for name in environment if name.startswith("EXLQ_")}
    assert given, "no EXLQ_ variable found: the files' shape changed"
    assert given <= known, f"set but read by no worker: {sorted(given - known)}"


# ---------------------------------------------------------------------------- gateways
# Both gateways in the image, the compose file and the Kubernetes manifests: the command
# they run, the port they listen on, the paths their probes ask and where their secrets
# come from, each checked against the gateway itself rather than a restated number.


@dataclass(frozen=True)
class Gateway:
    command: str  # exlq gateway <command>
    service: str  # its docker compose service
    name: str  # its Kubernetes Deployment and Service


GATEWAYS = (
    Gateway("openai", "openai-gateway", "exlq-openai-gateway"),
    Gateway("websocket", "websocket-gateway", "exlq-websocket-gateway"),
)
_IDS = [g.command for g in GATEWAYS]
_PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def _gateway_command(command: str) -> Any:
    """`exlq gateway <command>` as the exlq program has it (a typer command: its params)."""
    group = typer.main.get_command(exlq_app)
    assert isinstance(group, TyperGroup)
    gateways = group.commands["gateway"]
    assert isinstance(gateways, TyperGroup)
    return gateways.commands[command]


def _option(command: str, name: str) -> Any:
    return next(p for p in _gateway_command(command).params if p.name == name)


def default_port(gateway: Gateway) -> int:
    """The port the gateway listens on when neither --port nor EXLQ_PORT is given."""
    if gateway.command == "openai":  # its --port defaults to None: GatewaySettings decides
        port = GatewaySettings.model_fields["port"].default
    else:
        port = _option(gateway.command, "port").default
    assert isinstance(port, int)
    return port


def gateway_variables(gateway: Gateway) -> set[str]:
    """Every EXLQ_* variable the gateway reads."""
    if gateway.command == "openai":
        groups: list[type[BaseSettings]] = [GatewaySettings, BatchSettings]
        return {
            f"{group.model_config.get('env_prefix', '')}{field}".upper()
            for group in groups
            for field in group.model_fields
        }
    envvars = {p.envvar for p in _gateway_command(gateway.command).params}
    credentials = {f"EXLQ_REDIS_{field.upper()}" for field in RedisCredentials.model_fields}
    return {name for name in envvars if isinstance(name, str)} | credentials


def _ping_timeout(gateway: Gateway) -> float:
    """How long the gateway's /readyz waits for Redis before it answers 503."""
    return openai_app.READY_TIMEOUT_S if gateway.command == "openai" else ws_server.PING_TIMEOUT_S


class _Redis:
    """A Redis that answers PING, or is away."""

    def __init__(self, up: bool) -> None:
        self.up = up

    async def ping(self) -> bool:
        if not self.up:
            raise RedisConnectionError("Redis is away")
        return True


class _Connection:
    """What HealthChecks needs of a websockets connection: respond()."""

    def respond(self, status: HTTPStatus, text: str) -> Response:
        return Response(status.value, status.phrase, Headers(), text.encode())


async def asgi_get(app: Any, path: str) -> int:
    """The status an ASGI app answers a plain GET of ``path`` with, as a probe sends it (no
    Authorization header); the app's lifespan is not run."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"gateway"), (b"user-agent", b"kube-probe/1.30")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    statuses = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await app(scope, receive, send)
    (status,) = statuses
    return cast(int, status)


async def answer(gateway: Gateway, path: str, *, redis_up: bool) -> int:
    """The status the gateway answers a probe's plain GET of ``path`` with (API keys set,
    none sent); 0 for a path it hands on to the WebSocket handshake."""
    if gateway.command == "openai":
        app = openai_app.create_app(GatewaySettings(api_keys="a-key"))
        app.state.pool = SimpleNamespace(redis=_Redis(redis_up))  # no lifespan: no Redis
        assert await asgi_get(app, "/v1/models") == 401  # keys are asked for elsewhere
        return await asgi_get(app, path)
    checks = ws_server.HealthChecks(cast(Any, _Redis(redis_up)))
    response = await checks(cast(Any, _Connection()), Request(path, Headers()))
    return 0 if response is None else response.status_code


@functools.cache
def _compose() -> dict[str, Any]:
    """deploy/docker-compose.yml, parsed once (PyYAML is slow); not to be changed."""
    compose: dict[str, Any] = yaml.safe_load((ROOT / "deploy/docker-compose.yml").read_text())
    return compose


def _compose_service(gateway: Gateway) -> dict[str, Any]:
    service: dict[str, Any] = _compose()["services"][gateway.service]
    return service


@functools.cache
def _k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    objects = {}
    for path in sorted((ROOT / "deploy/kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and "metadata" in doc:
                objects[doc["kind"], doc["metadata"]["name"]] = doc
    return objects


def _pod(gateway: Gateway) -> dict[str, Any]:
    pod: dict[str, Any] = _k8s_objects()["Deployment", gateway.name]["spec"]["template"]["spec"]
    return pod


def _container(gateway: Gateway) -> dict[str, Any]:
    (container,) = _pod(gateway)["containers"]
    return cast(dict[str, Any], container)


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container["env"]}


def _compose_healthcheck(service: dict[str, Any]) -> tuple[int, str]:
    """The port and path of the URL a compose healthcheck opens."""
    found = re.search(
        r"http://127\.0\.0\.1:(\d+)(/[a-z]+)", " ".join(service["healthcheck"]["test"])
    )
    assert found, service["healthcheck"]
    return int(found[1]), found[2]


def _dockerfile_stage(name: str) -> str:
    text = (ROOT / "Dockerfile").read_text()
    stage = text.split(f" AS {name}\n", 1)[1]
    return stage.split("\nFROM ", 1)[0]


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR} and ${VAR:-default} (defaults nested), for the values used here."""
    out, i = [], 0
    while (start := text.find("${", i)) >= 0:
        depth, end = 1, start + 2
        while depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        name, nested, default = text[start + 2 : end - 1].partition(":-")
        out += [text[i:start], env.get(name) or (interpolate(default, env) if nested else "")]
        i = end
    return "".join([*out, text[i:]])


@pytest.mark.parametrize("gateway", GATEWAYS, ids=_IDS)
def test_each_gateway_runs_its_command(gateway: Gateway) -> None:
    args = ["gateway", gateway.command]
    _gateway_command(gateway.command)  # `exlq gateway <command>` exists
    stage = _dockerfile_stage("gateway")
    assert 'ENTRYPOINT ["exlq"]' in stage
    assert 'CMD ["gateway", "openai"]' in stage
    assert _compose_service(gateway)["command"] == args
    assert "entrypoint" not in _compose_service(gateway)
    assert _container(gateway)["args"] == args
    assert "command" not in _container(gateway)  # the image's ENTRYPOINT, exlq


@pytest.mark.parametrize("gateway", GATEWAYS, ids=_IDS)
def test_each_gateway_listens_on_every_interface(gateway: Gateway) -> None:
    assert "ENV EXLQ_HOST=0.0.0.0" in _dockerfile_stage("gateway")
    assert _compose_service(gateway)["environment"]["EXLQ_HOST"] == "0.0.0.0"
    assert _env(_container(gateway))["EXLQ_HOST"]["value"] == "0.0.0.0"


@pytest.mark.parametrize("gateway", GATEWAYS, ids=_IDS)
def test_compose_gateway_port_and_healthcheck(gateway: Gateway) -> None:
    port = default_port(gateway)
    service = _compose_service(gateway)
    assert service["environment"]["EXLQ_PORT"] == str(port)
    assert service["ports"] == [f"127.0.0.1:{port}:{port}"]
    assert _compose_healthcheck(service) == (port, "/readyz")
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert {"echo", "gpu"} <= set(service["profiles"])


@pytest.mark.parametrize("gateway", GATEWAYS, ids=_IDS)
def test_k8s_gateway_ports_and_probes(gateway: Gateway) -> None:
    port = default_port(gateway)
    container = _container(gateway)
    assert _env(container)["EXLQ_PORT"]["value"] == str(port)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert list(ports.values()) == [port]
    for probe in _PROBES:
        assert ports[container[probe]["httpGet"]["port"]] == port, probe
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    readiness = container["readinessProbe"]
    assert readiness["httpGet"]["path"] == "/readyz"
    # Longer than the gateway's own wait for Redis: the probe hears its 503, not a timeout.
    assert readiness["timeoutSeconds"] > _ping_timeout(gateway)
    service = _k8s_objects()["Service", gateway.name]["spec"]
    assert (
        service["selector"]
        == _k8s_objects()["Deployment", gateway.name]["spec"]["selector"]["matchLabels"]
    )
    assert [ports[p["targetPort"]] for p in service["ports"]] == [port]


@pytest.mark.parametrize("gateway", GATEWAYS, ids=_IDS)
async def test_probe_paths_are_the_gateways_health_answers(gateway: Gateway) -> None:
    """Liveness asks a path that stays 200 while Redis is away (an outage restarts no
    gateway); readiness one that turns 503 (the Service stops sending it requests)."""
    container = _container(gateway)
    alive = {container[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe")}
    ready = {container["readinessProbe"]["httpGet"]["path"]}
    ready.add(_compose_healthcheck(_compose_service(gateway))[1])
    for path in alive:
        assert await answer(gateway, path, redis_up=False) == 200, path
    for path in ready:
        assert await answer(gateway, path, redis_up=True) == 200, path
        assert await answer(gateway, path, redis_up=False) == 503, path


def test_image_health_check_probes_both_gateways_default_ports() -> None:
    stage = _dockerfile_stage("gateway")
    defaults = [str(default_port(g)) for g in GATEWAYS]
    assert f"${{EXLQ_PORT:-{' '.join(defaults)}}}" in stage
    assert f"EXPOSE {' '.join(defaults)}" in stage
    assert "/healthz" in stage.split("HEALTHCHECK", 1)[1]


@pytest.mark.parametrize("gateway", GATEWAYS, ids=_IDS)
def test_gateways_set_only_variables_they_read(gateway: Gateway) -> None:
    known = gateway_variables(gateway)
    given = {n for n in _compose_service(gateway)["environment"] if n.startswith("EXLQ_")}
    given |= {n for n in _env(_container(gateway)) if n.startswith("EXLQ_")}
    assert {"EXLQ_REDIS_URL", "EXLQ_HOST", "EXLQ_PORT"} <= given
    assert given <= known, f"set but not read by the {gateway.command} gateway: {given - known}"


def test_compose_websocket_gateway_serves_the_workers_queue() -> None:
    """No setting: the echo worker's queue; a model named: the GPU worker's (the model's
    folder name); EXLQ_QUEUE: that queue, which the GPU worker takes too."""
    compose = _compose()["services"]
    queue = compose["websocket-gateway"]["environment"]["EXLQ_QUEUE"]
    echo_queue = compose["echo-worker"]["environment"]["EXLQ_QUEUE"]
    assert interpolate(queue, {}) == interpolate(echo_queue, {}) == "echo"
    assert interpolate(queue, {"EXLQ_ECHO_QUEUE": "e"}) == interpolate(
        echo_queue, {"EXLQ_ECHO_QUEUE": "e"}
    )
    model = Path(
        interpolate(compose["worker"]["environment"]["EXLQ_MODEL"], {"EXLQ_MODEL_NAME": "m"})
    )
    assert interpolate(queue, {"EXLQ_MODEL_NAME": "m"}) == model.name
    assert interpolate(queue, {"EXLQ_QUEUE": "q", "EXLQ_MODEL_NAME": "m"}) == "q"


def test_k8s_websocket_gateway_serves_the_workers_queue() -> None:
    ref = _env(_container(GATEWAYS[1]))["EXLQ_QUEUE"]["valueFrom"]["configMapKeyRef"]
    assert (ref["name"], ref["key"]) == ("exlq-worker", "EXLQ_QUEUE")


def test_k8s_gateways_reach_redis_as_the_worker_does() -> None:
    worker = _k8s_objects()["Deployment", "exlq-worker"]["spec"]["template"]["spec"]
    (worker_container,) = worker["containers"]
    wanted = {k: v for k, v in _env(worker_container).items() if "REDIS" in k}
    for gateway in GATEWAYS:
        env = _env(_container(gateway))
        assert {k: v for k, v in env.items() if "REDIS" in k} == wanted, gateway.name
        # $(...) expands only variables listed before it.
        names = list(env)
        assert names.index("EXLQ_REDIS_URL") > names.index("REDIS_ADDRESS")


def test_no_secret_is_inlined() -> None:
    """Keys and passwords come from Secrets or files, and the shipped ones hold none."""
    for gateway in GATEWAYS:
        compose_env = _compose_service(gateway)["environment"]
        assert "EXLQ_API_KEYS" not in compose_env
        assert "@" not in compose_env["EXLQ_REDIS_URL"]  # no password in the URL
        for name, item in _env(_container(gateway)).items():
            assert name != "EXLQ_API_KEYS"
            if "PASSWORD" in name:
                assert "secretKeyRef" in item["valueFrom"], name
    assert "EXLQ_API_KEYS" not in _dockerfile_stage("gateway")


def test_openai_gateway_keys_come_from_a_file_that_holds_none_in_git(tmp_path: Path) -> None:
    compose = _compose()
    service = compose["services"]["openai-gateway"]
    keys_file = Path(service["environment"]["EXLQ_API_KEYS_FILE"])
    assert keys_file.parent == Path("/run/secrets") and keys_file.name in service["secrets"]
    source = interpolate(compose["secrets"][keys_file.name]["file"], {})
    assert load_keys(ROOT / "deploy" / source, None) == frozenset()

    container = _container(GATEWAYS[0])
    keys_file = Path(_env(container)["EXLQ_API_KEYS_FILE"]["value"])
    (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == keys_file.parent]
    volumes = {v["name"]: v for v in _pod(GATEWAYS[0])["volumes"]}
    secret_name = volumes[mount["name"]]["secret"]["secretName"]
    shipped = tmp_path / "keys"
    shipped.write_text(_k8s_objects()["Secret", secret_name]["stringData"][keys_file.name])
    assert load_keys(shipped, None) == frozenset()


def test_k8s_openai_gateway_is_replicated_and_stops_gracefully() -> None:
    objects = _k8s_objects()
    spec = objects["Deployment", "exlq-openai-gateway"]["spec"]
    assert spec["replicas"] >= 2
    assert (
        objects["PodDisruptionBudget", "exlq-openai-gateway"]["spec"]["minAvailable"]
        < spec["replicas"]
    )
    for gateway in GATEWAYS:
        pod, container = _pod(gateway), _container(gateway)
        sleep = container["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep" and int(sleep[1]) < pod["terminationGracePeriodSeconds"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_kustomization_ships_the_gateways_and_names_their_image() -> None:
    root = ROOT / "deploy/kubernetes"
    kustomization = yaml.safe_load((root / "kustomization.yaml").read_text())
    images = {image["name"] for image in kustomization["images"]}
    for gateway in GATEWAYS:
        files = [
            r
            for r in kustomization["resources"]
            if any(
                d and d["metadata"]["name"] == gateway.name
                for d in yaml.safe_load_all((root / r).read_text())
            )
        ]
        assert files, f"{gateway.name} is in no resource of kustomization.yaml"
        image = _container(gateway)["image"].split(":")[0]
        assert image in images


# ------------------------------------------------------------- schemas, exporter, password
# Every manifest kustomize applies is valid for its kind: Kubernetes' own kinds against the
# API's schemas (kubernetes-validate, offline, one pinned version), KEDA's against its CRDs'
# schemas (vendored in tests/schemas/ from KEDA v2.20.2), the compose file against the
# Compose Specification (as check-jsonschema ships it). Strict: a misspelt field fails.

K8S_VERSION = "1.30.0"
SCHEMAS = ROOT / "tests/schemas"
_KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}


def _rendered() -> list[dict[str, Any]]:
    """What `kubectl kustomize deploy/kubernetes` applies, for what is checked here: the
    objects of every file in its resources, with its image names and tags set."""
    root = ROOT / "deploy/kubernetes"
    kustomization = yaml.safe_load((root / "kustomization.yaml").read_text())
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in kustomization["images"]}
    objects = [
        doc
        for resource in kustomization["resources"]
        for doc in yaml.safe_load_all((root / resource).read_text())
        if doc
    ]
    for obj in objects:
        if obj["kind"] == "Deployment":
            for container in obj["spec"]["template"]["spec"]["containers"]:
                container["image"] = images[container["image"].split(":")[0]]
    return objects


def _closed(schema: Any) -> Any:
    """``schema`` with no property left open that it does not name (as the API server's
    strict field validation): KEDA's CRDs allow any, and prune what they do not know."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if (
        "properties" in closed
        and "additionalProperties" not in closed
        and not closed.get("x-kubernetes-preserve-unknown-fields")
    ):
        closed["additionalProperties"] = False
    return closed


def _keda_schema(kind: str) -> dict[str, Any]:
    schema = json.loads((SCHEMAS / f"keda-{kind.lower()}-v1alpha1.json").read_text())
    return cast(dict[str, Any], _closed(schema))


def test_every_kubernetes_object_is_valid_for_its_kind() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objects = _rendered()
    assert {o["kind"] for o in objects} >= {"Deployment", "PodDisruptionBudget", *_KEDA_KINDS}
    for obj in objects:
        if obj["kind"] in _KEDA_KINDS:
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_keda_objects_are_valid_for_kedas_crds() -> None:
    import jsonschema

    checked = 0
    for obj in _rendered():
        if obj["kind"] in _KEDA_KINDS:
            assert obj["apiVersion"] == "keda.sh/v1alpha1"
            jsonschema.validate(obj, _keda_schema(obj["kind"]))
            checked += 1
    assert checked == 2


def test_a_misspelt_keda_field_is_caught() -> None:
    """The check above can fail: KEDA's schema, closed, refuses a field it does not name."""
    import jsonschema

    scaled = next(o for o in _rendered() if o["kind"] == "ScaledObject")
    scaled["spec"]["minReplicas"] = 1  # minReplicaCount, misspelt
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        jsonschema.validate(scaled, _keda_schema("ScaledObject"))


def test_compose_file_is_valid_for_the_compose_specification() -> None:
    pytest.importorskip("check_jsonschema")
    import importlib.resources

    import jsonschema

    vendored = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads((vendored / "compose-spec.json").read_text())
    jsonschema.validate(_compose(), schema)


def test_keda_owns_the_worker_count_and_drains_take_one_at_a_time() -> None:
    objects = _k8s_objects()
    worker = objects["Deployment", "exlq-worker"]
    assert "replicas" not in worker["spec"]
    assert objects["ScaledObject", "exlq-worker"]["spec"]["scaleTargetRef"]["name"] == "exlq-worker"
    budget = objects["PodDisruptionBudget", "exlq-worker"]["spec"]
    assert budget["maxUnavailable"] == 1
    assert budget["selector"]["matchLabels"] == worker["spec"]["selector"]["matchLabels"]


def test_one_secret_holds_the_password_for_keda_and_every_exlq_pod() -> None:
    """KEDA and exlq read the same key of the same Secret, raw; no URL carries a password."""
    objects = _k8s_objects()
    (ref,) = objects["TriggerAuthentication", "exlq-redis"]["spec"]["secretTargetRef"]
    secret = (ref["name"], ref["key"])
    assert ref["parameter"] == "password"
    for name in ("exlq-worker", *(g.name for g in GATEWAYS), "exlq-exporter"):
        pod = objects["Deployment", name]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = _env(container)
        key = env["EXLQ_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert (key["name"], key["key"]) == secret, name
        assert env["EXLQ_REDIS_URL"]["value"] == "redis://$(REDIS_ADDRESS)/0", name
        assert "REDIS_PASSWORD" not in env, name
    compose = _compose()
    for name, service in compose["services"].items():
        environment = service.get("environment") or {}
        if "EXLQ_REDIS_URL" in environment:
            assert "@" not in environment["EXLQ_REDIS_URL"], name
            assert "EXLQ_REDIS_PASSWORD" in environment["EXLQ_REDIS_PASSWORD"], name
    redis_command = compose["services"]["redis"]["command"]
    assert redis_command[redis_command.index("--requirepass") + 1].startswith(
        "${EXLQ_REDIS_PASSWORD:?"
    )
    conf = (ROOT / "deploy/redis/redis.conf").read_text()
    assert re.search(r"^protected-mode yes$", conf, re.MULTILINE)


EXPORTER_PORT = 9410  # `exlq exporter`'s default port, checked below where it is installed


def test_the_exporter_runs_its_command_on_its_port_in_the_smallest_image() -> None:
    port = EXPORTER_PORT
    (deployment,) = [o for o in _rendered() if o["metadata"]["name"] == "exlq-exporter"]
    assert deployment["spec"]["replicas"] == 1
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["exporter", "--port", str(port)]
    assert container["image"] == "exlq-worker:lite"  # the base install: no gateway extra
    assert [p["containerPort"] for p in container["ports"]] == [port]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    service = _compose()["services"]["exporter"]
    assert service["command"] == ["exporter", "--port", str(port)]
    assert service["build"]["target"] == "lite"
    assert _compose_healthcheck(service) == (port, "/healthz")
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert jobs["exlq-exporter"]["static_configs"][0]["targets"] == [f"exporter:{port}"]
    assert jobs["exlq-redis"]["dns_sd_configs"][0]["names"] == ["redis-exporter"]


def test_the_exporter_command_listens_where_the_deploy_files_say() -> None:
    import inspect

    commands = pytest.importorskip("exlq.ops.queue_commands")
    exporter = inspect.signature(commands.exporter).parameters
    assert exporter["port"].default == EXPORTER_PORT
