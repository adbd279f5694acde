"""The Kubernetes manifests (deploy/kubernetes) rendered by a real kustomize (`kubectl
kustomize`, offline), validated against Kubernetes' schemas and checked for what the deployment
relies on."""

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = ["production", "small"]


def render(overlay: str) -> dict[str, dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is missing: apt-get install -y kubectl")
    out = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {doc["kind"]: doc for doc in yaml.safe_load_all(out) if doc}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_fits_the_kubernetes_schemas(overlay: str) -> None:
    """Every object against the newest Kubernetes schemas kubernetes-validate ships, strictly
    (no unknown field). The ServiceMonitor is a CRD with no schema there: the test below checks
    that it selects the Service and scrapes its port."""
    version = kubernetes_validate.latest_version()
    for kind, doc in render(overlay).items():
        if kind != "ServiceMonitor":
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_a_safe_deployment(overlay: str) -> None:
    docs = render(overlay)
    assert set(docs) >= {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "NetworkPolicy",
        "ServiceMonitor",
        "ConfigMap",
        "Job",
    }
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= 600
    assert container["envFrom"] == [{"secretRef": {"name": "metering-secrets"}}]
    # The catalog is a mounted directory (no subPath), so ConfigMap edits reach the pod.
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert "subPath" not in mounts["catalog"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["METERING_CONFIG"] == mounts["catalog"]["mountPath"] + "/metering.toml"
    assert "metering.toml" in docs["ConfigMap"]["data"]
    selector = docs["Service"]["spec"]["selector"]
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    monitor = docs["ServiceMonitor"]["spec"]
    assert (
        monitor["selector"]["matchLabels"].items() <= docs["Service"]["metadata"]["labels"].items()
    )
    assert monitor["endpoints"][0]["port"] == docs["Service"]["spec"]["ports"][0]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_migrations_run_as_a_job_the_new_pods_wait_for(overlay: str) -> None:
    """The job migrates (under the advisory lock, `metering db upgrade`) with the Deployment's
    image and secret; each pod's init container waits for the schema (`metering db wait`); the
    server then migrates nothing (--no-migrate). The job's pod is neither served nor counted
    by the Service and the PodDisruptionBudget."""
    docs = render(overlay)
    job = docs["Job"]
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (migrator,) = job["spec"]["template"]["spec"]["containers"]
    (waiter,) = pod["initContainers"]
    (server,) = pod["containers"]
    assert migrator["args"] == ["metering", "db", "upgrade"]
    assert waiter["args"][:3] == ["metering", "db", "wait"]
    assert "--no-migrate" in server["args"]
    assert migrator["image"] == waiter["image"] == server["image"]
    assert migrator["envFrom"] == waiter["envFrom"] == server["envFrom"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
    job_labels = job["spec"]["template"]["metadata"]["labels"]
    for selector in (
        docs["Service"]["spec"]["selector"],
        docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
    ):
        assert not selector.items() <= job_labels.items()
