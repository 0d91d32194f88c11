"""The deployment recipes in deploy/ and the Dockerfile: valid for the tools that will read them
(the Kubernetes API schemas, offline, with kubernetes-validate; systemd-analyze verify), their
drain commands accepted by this fleetless, and their timings consistent with its shutdown."""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from fleetless.cli import cli

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
# The newest schemas the validator ships, and the oldest Kubernetes these manifests are for
# (appArmorProfile and procMount: Unmasked with hostUsers: false are there from 1.30).
K8S_VERSIONS = ("latest", "1.30.0")
SHUTDOWN_GRACE = 30  # drain --shutdown-grace's default


def manifests() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / "kubernetes-cronjob.yaml").read_text()) if d]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    job = doc["spec"]["jobTemplate"]["spec"] if doc["kind"] == "CronJob" else doc["spec"]
    return job["template"]["spec"]  # type: ignore[no-any-return]


def job_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["jobTemplate"]["spec"] if doc["kind"] == "CronJob" else doc["spec"]  # type: ignore[no-any-return]


def parse_drain(args: list[str]) -> dict[str, Any]:
    """The options ``fleetless drain`` makes of these arguments (click raises on a bad one)."""
    assert args[0] == "drain", args
    drain = cli.commands["drain"]
    with drain.make_context("drain", list(args[1:]), resilient_parsing=False) as ctx:
        return dict(ctx.params)


def seconds(value: str) -> float:
    return float(value[:-1]) * {"s": 1, "m": 60, "h": 3600}[value[-1]] if value[-1].isalpha() else float(value)


def validate(doc: dict[str, Any], version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    kv.validate(doc, kv.latest_version() if version == "latest" else version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_kubernetes_manifests_are_valid_against_the_api_schemas(version: str) -> None:
    docs = manifests()
    assert [d["kind"] for d in docs] == ["CronJob", "Job"]
    for doc in docs:
        validate(doc, version)


def test_the_validator_does_reject_a_broken_manifest() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    job = manifests()[1]
    for mutate in (lambda j: j["spec"].__setitem__("parallelism", "eight"),  # a wrong type
                   lambda j: j["spec"].__setitem__("parallelizm", 8),  # a misspelt field (strict)
                   lambda j: pod_spec(j)["containers"][0].pop("name"),  # a required one missing
                   lambda j: pod_spec(j)["containers"][0]["securityContext"].__setitem__("procMount", 1)):
        broken = copy.deepcopy(job)
        mutate(broken)
        with pytest.raises(kv.ValidationError):
            validate(broken, "latest")


def test_the_burst_job_runs_n_drainers_that_each_end_when_the_queue_is_empty() -> None:
    job = manifests()[1]
    spec = job["spec"]
    assert spec["parallelism"] > 1 and "completions" not in spec and spec["completionMode"] == "NonIndexed"
    assert spec["activeDeadlineSeconds"] > 0


@pytest.mark.parametrize("kind", ["CronJob", "Job"])
def test_each_pod_runs_a_valid_drain_that_finishes_before_kubernetes_kills_it(kind: str) -> None:
    (doc,) = [d for d in manifests() if d["kind"] == kind]
    pod = pod_spec(doc)
    (container,) = pod["containers"]
    options = parse_drain(container["args"])
    grace = options["shutdown_grace"] if options["shutdown_grace"] is not None else SHUTDOWN_GRACE
    # SIGTERM, then the drainer's grace for running jobs, then it returns their claims: all of it
    # inside the pod's grace; and the run budget plus that grace inside the Job's deadline.
    assert pod["terminationGracePeriodSeconds"] > grace
    assert job_spec(doc)["activeDeadlineSeconds"] > options["max_runtime"] + grace
    # bwrap's needs, nothing privileged.
    assert options["sandbox"] == "bwrap"
    ctx, pod_ctx = container["securityContext"], pod["securityContext"]
    assert ctx["procMount"] == "Unmasked" and pod["hostUsers"] is False
    assert pod_ctx["seccompProfile"] == {"type": "Unconfined"} and pod_ctx["runAsNonRoot"] is True
    assert ctx["privileged"] is False and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert {"cpu", "memory"} <= container["resources"]["limits"].keys()
    # Workspaces on the writable volume the Dockerfile points FLEETLESS_WORKDIR at.
    workdir = re.search(r"FLEETLESS_WORKDIR=(\S+)", (ROOT / "Dockerfile").read_text())
    assert workdir and {m["mountPath"] for m in container["volumeMounts"]} == {workdir.group(1)}


def test_the_dockerfile_installs_every_tiers_system_packages_and_runs_the_drainer_under_tini() -> None:
    text = (ROOT / "Dockerfile").read_text()
    install = re.search(r"apt-get install -y --no-install-recommends(.*?)&&", text, re.S)
    assert install
    packages = set(re.findall(r"[a-z0-9][a-z0-9.+-]+", install.group(1).replace("\\\n", " ")))
    ci = (ROOT / ".ci" / "run").read_text()
    microvm = {"qemu-system-x86", "busybox-static", "lz4", "cpio"}
    assert microvm <= set(re.findall(r"need\+=\(([a-z0-9-]+)\)", ci))  # the same list CI installs
    assert microvm | {"bubblewrap", "python3", "python3-venv", "tini"} <= packages, packages
    assert 'ENTRYPOINT ["/usr/bin/tini", "--", "fleetless"]' in text
    assert re.search(r"^USER 10001$", text, re.M) and "fleetless microvm build-image" in text
    for source in re.findall(r"^COPY (.+) /\S+$", text, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), path


def test_the_systemd_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here")
    fleetless = Path(sys.executable).with_name("fleetless")
    for unit in ("fleetless-drain.service", "fleetless-drain.timer"):
        # The unit as shipped, with its ExecStart pointing at this fleetless (verify checks that
        # the binary exists).
        text = (DEPLOY / unit).read_text().replace("/opt/app/.venv/bin/fleetless", str(fleetless))
        (tmp_path / unit).write_text(text)
        (tmp_path / unit).chmod(0o644)  # systemd warns about world-writable units (whatever the umask)
    r = subprocess.run([analyze, "verify", str(tmp_path / "fleetless-drain.service"),
                        str(tmp_path / "fleetless-drain.timer")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


def test_the_service_stops_the_drainer_within_its_stop_timeout() -> None:
    unit = (DEPLOY / "fleetless-drain.service").read_text()
    argv = shlex.split(re.search(r"^ExecStart=(.+)$", unit, re.M).group(1))  # type: ignore[union-attr]
    options = parse_drain(argv[1:])
    grace = options["shutdown_grace"] if options["shutdown_grace"] is not None else SHUTDOWN_GRACE
    stop_timeout = seconds(re.search(r"^TimeoutStopSec=(\S+)$", unit, re.M).group(1))  # type: ignore[union-attr]
    assert stop_timeout > grace
    assert re.search(r"^KillSignal=SIGTERM$", unit, re.M) and re.search(r"^KillMode=mixed$", unit, re.M)


def test_the_cron_entries_run_valid_commands() -> None:
    lines = [ln for ln in (DEPLOY / "cron.d-fleetless").read_text().splitlines()
             if ln.strip() and not ln.startswith("#") and "=" not in ln.split()[0]]
    assert lines
    for line in lines:
        command = shlex.split(line)[6:]  # minute hour day month weekday user, then the command
        sub = command[command.index(next(c for c in command if c.endswith("/fleetless"))) + 1:]
        sub = [a for a in sub if not a.startswith(">>") and a != "2>&1"]
        if sub[0] == "drain":
            parse_drain(sub)
        else:
            with cli.commands[sub[0]].make_context(sub[0], sub[1:]) as ctx:
                assert isinstance(ctx, click.Context)
