#!/usr/bin/env bash
# Static checks of deploy/ and grafana/: YAML and JSON parse, cross-file settings agree,
# the dashboard is well formed, and, where the tools are installed, promtool (config,
# rules, rule unit tests), kustomize (kubectl kustomize), kubernetes-validate and the
# Compose Specification schema (check-jsonschema). Missing tools are skipped, not failed.
#
#   bash deploy/check.sh            (needs python3 with PyYAML)
#   apt-get install prometheus kubectl; pip install kubernetes-validate check-jsonschema
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
fail=0
skip() { echo "SKIP $*"; }

echo "== YAML / JSON / consistency"
"$PY" - <<'EOF' || fail=1
import glob, json, re, sys
try:
    import yaml
except ImportError:
    sys.exit("PyYAML is missing: pip install pyyaml")

errors = []
docs = {}
for path in sorted(glob.glob("deploy/**/*.y*ml", recursive=True) + glob.glob("grafana/**/*.y*ml", recursive=True)):
    try:
        docs[path] = [d for d in yaml.safe_load_all(open(path)) if d is not None]
    except yaml.YAMLError as e:
        errors.append(f"{path}: {e}")
print(f"parsed {len(docs)} YAML files")

# The dashboard.
for path in sorted(glob.glob("grafana/dashboards/*.json")):
    d = json.load(open(path))
    ids = [p["id"] for p in d["panels"]]
    if len(ids) != len(set(ids)):
        errors.append(f"{path}: duplicate panel ids")
    if not 36 <= d.get("schemaVersion", 0) <= 41:
        errors.append(f"{path}: schemaVersion {d.get('schemaVersion')}")
    names = [v["name"] for v in d["templating"]["list"]]
    if "queue" not in names:
        errors.append(f"{path}: no queue variable")
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        if g["x"] + g["w"] > 24:
            errors.append(f"{path}: panel {p['title']!r} wider than the grid")
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                if (x, y) in cells:
                    errors.append(f"{path}: panel {p['title']!r} overlaps another")
                    break
                cells.add((x, y))
        for t in p.get("targets", []):
            if 'queue=~"$queue"' not in t["expr"]:
                errors.append(f"{path}: {p['title']!r} ignores $queue")
            if "_bucket" in t["expr"] and "by (le)" not in t["expr"]:
                errors.append(f"{path}: {p['title']!r} histogram not summed by le")
        if p["type"] != "row" and p.get("datasource", {}).get("uid") != "${datasource}":
            errors.append(f"{path}: {p['title']!r} does not use the datasource variable")
    print(f"{path}: {len(d['panels'])} panels")

ds = docs["grafana/provisioning/datasources/prometheus.yml"][0]["datasources"][0]
dash = json.load(open("grafana/dashboards/exlq-overview.json"))
dsvar = next(v for v in dash["templating"]["list"] if v["name"] == "datasource")
if dsvar["current"]["value"] != ds["uid"]:
    errors.append("dashboard datasource default != provisioned datasource uid")

# Kubernetes: queue, batch size and grace agree across files. Objects by kind and name
# (there are several Deployments: the worker's and the gateways').
k8s = {}
for path, ds_ in docs.items():
    if path.startswith("deploy/kubernetes/"):
        for doc in ds_:
            if isinstance(doc, dict) and "kind" in doc:
                k8s[doc["kind"], doc.get("metadata", {}).get("name")] = doc
cm = k8s["ConfigMap", "exlq-worker"]["data"]
so = k8s["ScaledObject", "exlq-worker"]["spec"]
dep = k8s["Deployment", "exlq-worker"]["spec"]["template"]["spec"]
stream = f"{cm['EXLQ_PREFIX']}:{{{cm['EXLQ_QUEUE']}}}:jobs"
for t in so["triggers"]:
    if t["metadata"]["stream"] != stream:
        errors.append(f"keda.yaml: trigger {t['name']} stream {t['metadata']['stream']} != {stream}")
    if t["metadata"].get("consumerGroup") != "workers":
        errors.append(f"keda.yaml: trigger {t['name']} consumerGroup must be 'workers'")
    for k, v in t["metadata"].items():
        if not isinstance(v, str):
            errors.append(f"keda.yaml: metadata {k} must be a string, got {v!r}")
if so["advanced"]["scalingModifiers"]["target"] != cm["EXLQ_MAX_BATCH_SIZE"]:
    errors.append("keda.yaml: scalingModifiers.target != EXLQ_MAX_BATCH_SIZE")
if not dep["terminationGracePeriodSeconds"] > int(cm["EXLQ_GRACE_SECONDS"]):
    errors.append("deployment.yaml: terminationGracePeriodSeconds must exceed EXLQ_GRACE_SECONDS")
if dep["containers"][0]["resources"]["limits"].get("nvidia.com/gpu") != 1:
    errors.append("deployment.yaml: the worker must ask for one nvidia.com/gpu")
# Every file in deploy/kubernetes/ is one kustomize applies (a gateway left out is not shipped).
kustomization = docs["deploy/kubernetes/kustomization.yaml"][0]
listed = set(kustomization["resources"]) | {"kustomization.yaml", "podmonitor.yaml"}
for path in docs:
    if path.startswith("deploy/kubernetes/") and path.rsplit("/", 1)[1] not in listed:
        errors.append(f"{path}: not in kustomization.yaml's resources")
# A pod's preStop sleep counts against its grace: leave time after it.
for (kind, name), doc in k8s.items():
    if kind != "Deployment":
        continue
    pod = doc["spec"]["template"]["spec"]
    for c in pod["containers"]:
        sleep = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        if sleep[:1] == ["sleep"] and int(sleep[1]) >= pod.get("terminationGracePeriodSeconds", 30):
            errors.append(f"{name}: preStop sleep >= terminationGracePeriodSeconds")

# Compose: grace periods.
compose = docs["deploy/docker-compose.yml"][0]
for name in ("worker", "echo-worker"):
    svc = compose["services"][name]
    grace = int(svc["environment"]["EXLQ_GRACE_SECONDS"])
    stop = int(re.fullmatch(r"(\d+)s", svc["stop_grace_period"]).group(1))
    if stop <= grace:
        errors.append(f"docker-compose.yml: {name} stop_grace_period <= EXLQ_GRACE_SECONDS")

for e in errors:
    print("FAIL", e)
sys.exit(1 if errors else 0)
EOF

echo "== promtool"
if command -v promtool >/dev/null; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    cp deploy/prometheus/alerts.yml "$tmp/alerts.yml"
    sed "s#/etc/prometheus/alerts.yml#$tmp/alerts.yml#" deploy/prometheus/prometheus.yml > "$tmp/prometheus.yml"
    promtool check config "$tmp/prometheus.yml" || fail=1
    promtool check rules deploy/prometheus/alerts.yml || fail=1
    (cd deploy/prometheus/tests && promtool test rules alerts_test.yml) || fail=1
else
    skip "promtool not installed (apt-get install prometheus)"
fi

echo "== kustomize"
if command -v kubectl >/dev/null; then
    rendered=$(mktemp)
    kubectl kustomize deploy/kubernetes > "$rendered" || fail=1
    echo "rendered $(grep -c '^kind:' "$rendered") objects"
    if "$PY" -c "import kubernetes_validate" 2>/dev/null; then
        "$PY" -m kubernetes_validate --strict --quiet -k 1.30.0 "$rendered" || fail=1
    else
        skip "kubernetes-validate not installed"
    fi
    rm -f "$rendered"
else
    skip "kubectl not installed"
fi

echo "== KEDA schemas"
if "$PY" -c "import jsonschema" 2>/dev/null; then
    # KEDA's CRD schemas (vendored from KEDA v2.20.2 in tests/schemas/); kubernetes-validate
    # above knows only Kubernetes' own kinds and warns about these two.
    "$PY" - <<'EOF' || fail=1
import glob, json, sys
import jsonschema, yaml
schemas = {
    "ScaledObject": "tests/schemas/keda-scaledobject-v1alpha1.json",
    "TriggerAuthentication": "tests/schemas/keda-triggerauthentication-v1alpha1.json",
}
bad = 0
for path in sorted(glob.glob("deploy/kubernetes/*.yaml")):
    for doc in yaml.safe_load_all(open(path)):
        if doc and doc.get("kind") in schemas:
            try:
                jsonschema.validate(doc, json.load(open(schemas[doc["kind"]])))
            except jsonschema.ValidationError as e:
                print(f"{path}: {doc['kind']}: {e.message}")
                bad = 1
print("KEDA objects INVALID" if bad else "KEDA objects valid")
sys.exit(bad)
EOF
else
    skip "jsonschema not installed"
fi

echo "== compose schema"
if command -v check-jsonschema >/dev/null; then
    check-jsonschema --builtin-schema vendor.compose-spec deploy/docker-compose.yml || fail=1
else
    skip "check-jsonschema not installed"
fi

if [ "$fail" -ne 0 ]; then echo "deploy checks FAILED"; exit 1; fi
echo "deploy checks passed"
