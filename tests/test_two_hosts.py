"""Two hosts without a shared filesystem, on this box: each "host" is a ``ktflow worker`` in its own
mount and UTS namespace (its own hostname), with its own store, home (its own SSH key), Prefect
home, checkout path and copy of the inputs. In each namespace the other host's folder and the
artifact store's backing folder are covered by an empty tmpfs, so a host cannot read the other's
files even by mistake: what crosses hosts goes through the artifact store, a real SFTP server
(Debian's OpenSSH sshd), and Prefect's results through a RemoteFileSystem block on the same server.
The Prefect server runs on PostgreSQL. The training host runs download, dequantize and sft; the
serving host (the parent's control worker too: the registry lives with production) makes its own
base weights, fetches the adapter, verified, and converts, evaluates and serves it.

The code and toolchains are read from this checkout in both (software, not data), bind-mounted at
a different checkout path per host.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from distributed import stop_all_servers
from prefect_cluster import REPO, Cluster, free_port, postgres_skip_reason, prefect_cluster
from sftp_server import SftpServer, make_key, sftp_server, sftp_skip_reason

TRAIN, SERVE = "train-host", "serve-host"
HOST_ENV = {
    TRAIN: {"KT_KERNEL_CPU_VARIANT": "amx", "PREFECT_WORKER_HEARTBEAT_SECONDS": "5"},
    SERVE: {"KT_KERNEL_CPU_VARIANT": "avx512_bf16", "PREFECT_WORKER_HEARTBEAT_SECONDS": "5"},
}
STAGES = {"download", "dequantize", "sft", "convert-lora", "quantize-int8", "serve", "evaluate"}


def _namespace_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root for mount namespaces (unshare --mount)"
    if not shutil.which("unshare"):
        return "util-linux's unshare is not installed"
    probe = subprocess.run(["unshare", "--mount", "--uts", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"mount namespaces are not available here: {probe.stderr.decode().strip()}"
    return None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (REPO / ".venv-train").exists() or not (REPO / ".venv-serve").exists(),
                       reason="toolchains not installed (make test installs them)"),
    pytest.mark.skipif(postgres_skip_reason() is not None, reason=str(postgres_skip_reason())),
    pytest.mark.skipif(sftp_skip_reason() is not None, reason=str(sftp_skip_reason())),
    pytest.mark.skipif(_namespace_skip_reason() is not None, reason=str(_namespace_skip_reason())),
]


@dataclass
class TwoHosts:
    cluster: Cluster
    root: Path
    sftp: SftpServer
    recipe: dict

    def host(self, name: str) -> Path:
        return self.root / "hosts" / name

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    def run(self, recipe: dict, timeout: float = 900) -> tuple[str, dict]:
        done = self.cluster.prefect("deployment", "run", "ktflow-dispatch/pipeline", "--params",
                                    json.dumps({"recipe": recipe}), "--watch", timeout=timeout, check=False)
        run_id = next(line.split("UUID: ")[1].strip() for line in done.stdout.splitlines() if "UUID: " in line)
        return run_id, self.cluster.api("GET", f"/flow_runs/{run_id}")  # type: ignore[return-value]

    def why(self, run_id: str) -> str:
        """The run's state message and its failed child runs' last log lines (for an assertion's message)."""
        parent = self.cluster.api("GET", f"/flow_runs/{run_id}")
        children = self.cluster.api("POST", "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run_id]}}})
        lines: list[str] = []
        for child in [parent, *children]:  # type: ignore[list-item]
            if child["state_type"] != "COMPLETED":
                logs = self.cluster.api("POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [child["id"]]}},
                                                                "sort": "TIMESTAMP_DESC", "limit": 30})
                lines += [f"--- {child['name']} {child['state_type']}: {child['state']['message']}"]
                lines += [log["message"][-1500:] for log in reversed(logs)]  # type: ignore[arg-type]
        return "\n".join(lines)

    def trainings(self) -> int:
        """How many SFT runs trained (a cached one publishes no ``sft-summary``)."""
        return len(self.cluster.api("POST", "/artifacts/filter", {"artifacts": {"key": {"any_": ["sft-summary"]}}}))  # type: ignore[arg-type]

    def summary(self, run_id: str) -> dict[str, str]:
        """The pipeline-summary table's results by stage."""
        [artifact] = self.cluster.api("POST", "/artifacts/filter", {"artifacts": {
            "key": {"like_": "pipeline-summary"}, "flow_run_id": {"any_": [run_id]}}})  # type: ignore[misc]
        rows = json.loads(artifact["data"]) if isinstance(artifact["data"], str) else artifact["data"]
        return {row["stage"]: row["result"] for row in rows}

    def stage_hosts(self, run_id: str) -> dict[str, set[str]]:
        children = self.cluster.api("POST", "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run_id]}}})
        where: dict[str, set[str]] = {}
        for artifact in self.cluster.api("POST", "/artifacts/filter", {"artifacts": {  # type: ignore[union-attr]
                "key": {"like_": "stage-host-"}, "flow_run_id": {"any_": [c["id"] for c in children]}}}):  # type: ignore[union-attr]
            [row] = json.loads(artifact["data"]) if isinstance(artifact["data"], str) else artifact["data"]
            where.setdefault(row["stage"], set()).add(row["host"])
        return where


def _namespace(host: Path, others: list[Path], inputs: Path, checkout: Path, hostname: str) -> list[str]:
    """The command line that runs a worker as its own "host": the other host's folder and the
    artifact store's backing folder hidden under empty tmpfs mounts, this host's inputs at the
    recipe's input path, this checkout bind-mounted at this host's checkout path."""
    script = "; ".join([*(f"mount -t tmpfs -o size=1m tmpfs {o}" for o in others),
                        f"mount --bind {host / 'inputs'} {inputs}", f"mount --bind {REPO} {checkout}",
                        f"hostname {hostname}", 'exec "$@"'])
    return ["unshare", "--mount", "--uts", "--propagation", "private", "--", "sh", "-ec", script, "sh"]


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoHosts]:
    from ktflow.demo import DEMO_MODEL, write_demo_dataset
    from ktflow.fixtures.checkpoints import make_fixture

    root = tmp_path_factory.mktemp("two-hosts")
    shared_inputs = root / "made"
    make_fixture(DEMO_MODEL, shared_inputs / "model")
    write_demo_dataset(shared_inputs / "data")
    inputs = root / "inputs"  # the recipe's input path: each host mounts its own copy there
    inputs.mkdir()
    (root / "artifacts/prefect-results").mkdir(parents=True)  # the results block's folder (fsspec makes no parents)
    keys = []
    for name in (TRAIN, SERVE):
        host = root / "hosts" / name
        shutil.copytree(shared_inputs, host / "inputs")  # each host has the same files on its own disk
        (host / "store").mkdir(parents=True)
        (host / "ktflow").mkdir()
        keys.append(make_key(host / "home/.ssh/id_ed25519"))
    recipe = yaml.safe_load((REPO / "recipes/tiny-demo.yaml").read_text())
    recipe["source"]["local_path"] = str(inputs / "model")
    recipe["dataset"]["files"] = [str(inputs / "data/train.jsonl")]
    recipe["evaluation"]["files"] = [str(inputs / "data/eval.jsonl")]
    recipe["evaluation"].update(gate_metric=None, gate_min_gain=0)  # this test is about hosts, not what SFT learns
    recipe["sft"].update(max_steps=40, save_steps=20)
    recipe["store"]["root"] = "/srv/ktflow/store"  # the recipe's name for it; each host's worker has its own
    recipe["serving"]["port"] = free_port()
    recipe["toolchains"] = {role: {"python": str(REPO / f".venv-{role}/bin/python")} for role in ("train", "serve")}

    with sftp_server(root / "sshd", authorized=[Path(f"{k}.pub") for k in keys]) as sftp, \
            prefect_cluster(root / "prefect", database="postgres") as cluster:
        recipe["store"]["artifacts"] = sftp.url(root / "artifacts")
        cluster.prefect("block", "register", "-m", "blocks")
        # Prefect's results of the stage runs go to the artifact store too, so the parent on the other
        # host reads them (the workers' own SSH keys log them in).
        # (Prefect's RemoteFileSystem hands fsspec its settings, not the URL's host: they are repeated there.)
        subprocess.run([sys.executable, "-c", "import json, sys\nfrom prefect.filesystems import RemoteFileSystem\n"
                        "RemoteFileSystem(basepath=sys.argv[1], settings=json.loads(sys.argv[2])).save('ktflow-results')",
                        sftp.url(root / "artifacts/prefect-results"),
                        json.dumps({"host": sftp.host, "port": sftp.port, "username": sftp.user})],
                       cwd=REPO, env=cluster.env, check=True, timeout=120)
        for name, pools in ((TRAIN, ["amx-train"]), (SERVE, ["ktflow-control", "avx512-serve"])):
            host = root / "hosts" / name
            other = root / "hosts" / (SERVE if name == TRAIN else TRAIN)
            env = {**HOST_ENV[name], "HOME": str(host / "home"), "PREFECT_HOME": str(host / "prefect-home"),
                   "PREFECT_LOCAL_STORAGE_PATH": str(host / "prefect-home/results"),
                   "PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": "remote-file-system/ktflow-results",
                   "KTFLOW_CHECKOUT": str(host / "ktflow")}
            cluster.start_worker(name, pools, env, checkout=host / "ktflow",
                                 extra_args=["--store-root", str(host / "store")],
                                 wrap=_namespace(host, [other, root / "artifacts", root / "sshd"], inputs,
                                                 host / "ktflow", name))
        try:
            yield TwoHosts(cluster=cluster, root=root, sftp=sftp, recipe=recipe)
        finally:
            # The serving host's endpoints, each with its whole tree (the server is no process-group
            # leader: a killpg of its pid reached nothing and left LlamaFactory's API running).
            stop_all_servers(root / "hosts" / SERVE / "store")


def test_the_pipeline_runs_across_two_hosts_that_share_only_the_artifact_store(two_hosts: TwoHosts) -> None:
    started = time.monotonic()
    run_id, run = two_hosts.run(two_hosts.recipe)
    assert run["state_type"] == "COMPLETED", two_hosts.why(run_id)
    where = two_hosts.stage_hosts(run_id)
    # Each host made its own base weights; the adapter was trained on one and served on the other.
    assert where == {"download": {TRAIN, SERVE}, "dequantize": {TRAIN, SERVE}, "sft": {TRAIN},
                     **{stage: {SERVE} for stage in ("convert-lora", "quantize-int8", "serve", "evaluate")}}, where
    summary = two_hosts.summary(run_id)
    # The serving host made its own base weights, and fetched the adapter through the artifact store.
    # (a local source is read in place: each host's own copy at the recipe's input path)
    model = two_hosts.root / "inputs/model"
    assert summary["download"] == f"{model}; serving host: {model}", summary["download"]
    assert "; serving host: /srv/ktflow/store/bf16/" in summary["dequantize"], summary["dequantize"]
    assert f"fetched from {two_hosts.recipe['store']['artifacts']}/runs/" in summary["convert-lora"], summary
    # Each host's store has what it made, under its own root; none of the paths the run recorded is a host's own.
    train, serve = (two_hosts.host(h) / "store" for h in (TRAIN, SERVE))
    assert list((train / "runs").glob("*/adapter/manifest.json")) and not (train / "adapters").exists()
    assert list((serve / "runs").glob("*/adapter/manifest.json")) and list((serve / "adapters").glob("*/manifest.json"))
    assert (serve / "registry/tiny-demo/production.json").is_file() and not (train / "registry").exists()
    text = json.dumps(summary)
    assert str(two_hosts.host(TRAIN)) not in text and str(two_hosts.host(SERVE)) not in text, text
    # The run report is written on the serving host, where the training host's loss curve file is not:
    # the curve travelled inside the SFT result and is embedded.
    [report] = two_hosts.cluster.api("POST", "/artifacts/filter", {"artifacts": {  # type: ignore[misc]
        "key": {"any_": ["pipeline-report"]}, "flow_run_id": {"any_": [run_id]}}})
    assert "![training loss](data:image/png;base64," in report["data"], report["data"][:3000]
    # What crossed: the adapter (its transfer manifest written last) and Prefect's results.
    [published] = list(two_hosts.artifacts.glob("runs/*/adapter/transfer.json"))
    first_s = time.monotonic() - started

    # A bit flipped in the stored adapter is caught when the serving host fetches it again.
    adapter = published.parent / "adapter_model.safetensors"
    data = bytearray(adapter.read_bytes())
    data[len(data) // 2] ^= 0x01
    adapter.write_bytes(bytes(data))
    fetched = serve / published.parent.relative_to(two_hosts.artifacts)
    shutil.rmtree(fetched)  # the serving host lost its copy: it must fetch again
    run_id, run = two_hosts.run(two_hosts.recipe)
    assert run["state_type"] == "FAILED", run["state"]
    message = run["state"]["message"]
    key = published.parent.relative_to(two_hosts.artifacts).as_posix()
    assert f"{key}/adapter_model.safetensors" in message and "sha256" in message, message
    assert not fetched.exists()  # nothing half-fetched under the final name
    assert two_hosts.trainings() == 1  # the training host did not train again

    # Mended (the bit flipped back), a rerun fetches it, and every stage is a cache hit across hosts.
    data[len(data) // 2] ^= 0x01
    adapter.write_bytes(bytes(data))
    run_id, run = two_hosts.run(two_hosts.recipe)
    assert run["state_type"] == "COMPLETED", two_hosts.why(run_id)
    summary = two_hosts.summary(run_id)
    assert summary["sft"].endswith("(cached)") and summary["dequantize"].count("(cached)") == 2, summary
    assert (fetched / "manifest.json").is_file() and two_hosts.trainings() == 1
    print(f"\ntwo hosts, no shared filesystem: first run {first_s:.0f} s; corrupt adapter refused; rerun cached")
