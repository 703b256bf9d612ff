"""The artifact store (ktflow.artifact_store) against a real SFTP server (OpenSSH's sshd), an S3-compatible
server (moto's, the S3 REST API on a local port) and file://:
atomic publication, verified fetches, a killed upload, a flipped bit, a truncated object."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sftp_server import SftpServer, sftp_server, sftp_skip_reason

from ktflow.artifact_store import TRANSFER_NAME, ArtifactRef, ArtifactStore, check_artifact_url
from ktflow.errors import ArtifactCorruptError, ArtifactNotPublishedError, RecipeError
from ktflow.store import StageManifest, publish_dir, read_manifest, staging_dir_for

REPO = Path(__file__).resolve().parents[1]


def make_artifact(final: Path, files: dict[str, bytes]) -> StageManifest:
    staging = staging_dir_for(final)
    for name, data in files.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_bytes(data)
    return publish_dir(staging, final, StageManifest(stage="sft", inputs={"data": "d1"}))


ADAPTER = {"adapter_model.safetensors": os.urandom(300_000), "adapter_config.json": b'{"r": 8}',
           "logs/trainer_log.jsonl": b'{"loss": 1.0}\n'}


@pytest.fixture(scope="module")
def sftp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SftpServer]:
    if sftp_skip_reason():
        pytest.skip(sftp_skip_reason())
    with sftp_server(tmp_path_factory.mktemp("sshd")) as server:
        yield server


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3-compatible server (its own HTTP server on a local port, the S3 REST API)."""
    moto_server = pytest.importorskip("moto.server", reason="moto (an S3-compatible server) is not installed")
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(params=["file", "sftp", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    """An artifact store on each backend: a folder, OpenSSH's SFTP server, an S3-compatible server."""
    if request.param == "file":
        (tmp_path / "remote").mkdir()
        return ArtifactStore(f"file://{tmp_path}/remote")
    if request.param == "sftp":
        server: SftpServer = request.getfixturevalue("sftp")
        (tmp_path / "remote").mkdir()
        return ArtifactStore(server.url(tmp_path / "remote"), server.options)
    import boto3

    endpoint = request.getfixturevalue("s3_endpoint")
    credentials = {"aws_access_key_id": "test", "aws_secret_access_key": "test", "region_name": "us-east-1"}
    bucket = f"ktflow-{tmp_path.name.lower().replace('_', '-')[-40:]}"
    boto3.client("s3", endpoint_url=endpoint, **credentials).create_bucket(Bucket=bucket)
    return ArtifactStore(f"s3://{bucket}/artifacts", {"key": "test", "secret": "test", "client_kwargs": {
        "endpoint_url": endpoint, "region_name": "us-east-1"}})


def _write(store: ArtifactStore, key: str, name: str, data: bytes) -> None:
    """Damage an object behind the store's back (what a bad disk or a hand edit does)."""
    with store.fs.open(store.object_path(key, name), "wb") as fh:
        fh.write(data)


def _read(store: ArtifactStore, key: str, name: str) -> bytes:
    with store.fs.open(store.object_path(key, name), "rb") as fh:
        return fh.read()


def test_a_published_artifact_is_fetched_whole_into_another_store_and_both_are_cached(
        store: ArtifactStore, tmp_path: Path) -> None:
    manifest = make_artifact(tmp_path / "a/runs/r1/adapter", ADAPTER)
    ref = store.publish(tmp_path / "a/runs/r1/adapter", "runs/r1/adapter")
    assert ref.digest == manifest.digest() and ref.files == 4 and ref.bytes > 300_000
    assert not [p for p in store.fs.find(store.object_path("runs")) if ".part" in p]
    # Published again: the same artifact is there, nothing is written.
    opened = []
    real_open = store.fs.open
    store.fs.open = lambda path, mode="rb", **kw: (opened.append((path, mode)), real_open(path, mode, **kw))[1]  # type: ignore[method-assign]
    try:
        assert store.publish(tmp_path / "a/runs/r1/adapter", "runs/r1/adapter") == ref
    finally:
        store.fs.open = real_open  # type: ignore[method-assign]
    assert [mode for _, mode in opened] == ["rb"], opened  # the transfer manifest, read

    got = store.fetch(ref, tmp_path / "b/runs/r1/adapter")
    for name, data in ADAPTER.items():
        assert (got / name).read_bytes() == data
    assert read_manifest(got).digest() == ref.digest  # type: ignore[union-attr]
    assert not staging_dir_for(got).exists()
    # Fetched again: it is there with the digest asked for, nothing is read from the store.
    store.fs.rm(store.object_path("runs/r1/adapter", "adapter_model.safetensors"))
    assert store.fetch(ref, got) == got


def test_a_flipped_bit_or_a_truncated_object_is_refused_naming_the_key_and_file(
        store: ArtifactStore, tmp_path: Path) -> None:
    make_artifact(tmp_path / "a/adapter", ADAPTER)
    ref = store.publish(tmp_path / "a/adapter", "runs/r2/adapter")
    data = bytearray(_read(store, "runs/r2/adapter", "adapter_model.safetensors"))
    data[123_456] ^= 0x10
    _write(store, "runs/r2/adapter", "adapter_model.safetensors", bytes(data))
    with pytest.raises(ArtifactCorruptError) as caught:
        store.fetch(ref, tmp_path / "b/adapter")
    message = str(caught.value)
    assert "runs/r2/adapter/adapter_model.safetensors" in message and "sha256" in message and "republish" in message
    assert not (tmp_path / "b/adapter").exists()  # nothing under the final name

    _write(store, "runs/r2/adapter", "adapter_model.safetensors", ADAPTER["adapter_model.safetensors"][:1000])
    with pytest.raises(ArtifactCorruptError, match="truncated"):
        store.fetch(ref, tmp_path / "b/adapter")
    assert not (tmp_path / "b/adapter").exists()
    # Republished (the producing stage's rerun), it fetches.
    store.fs.rm(store.object_path("runs/r2/adapter", TRANSFER_NAME))
    store.publish(tmp_path / "a/adapter", "runs/r2/adapter")
    assert store.fetch(ref, tmp_path / "b/adapter") == tmp_path / "b/adapter"


def test_nothing_published_or_another_artifact_under_the_key_is_refused(store: ArtifactStore, tmp_path: Path) -> None:
    with pytest.raises(ArtifactNotPublishedError, match="no complete artifact"):
        store.fetch(ArtifactRef(url=store.url, key="runs/none/adapter", digest="0" * 64), tmp_path / "x")
    make_artifact(tmp_path / "a/adapter", ADAPTER)
    ref = store.publish(tmp_path / "a/adapter", "runs/r3/adapter")
    with pytest.raises(ArtifactNotPublishedError, match="holds artifact"):
        store.fetch(ref.model_copy(update={"digest": "f" * 64}), tmp_path / "x")


_PUBLISH = """
import sys
from pathlib import Path
from ktflow.artifact_store import ArtifactStore
store = ArtifactStore(sys.argv[1], {"key_filename": sys.argv[2], "look_for_keys": False, "allow_agent": False})
def progress(done, total):
    print(done, total, flush=True)
store.publish(Path(sys.argv[3]), "runs/big/adapter", progress=progress)
"""


def test_an_upload_killed_mid_way_publishes_nothing_and_the_rerun_publishes_it_whole(
        sftp: SftpServer, tmp_path: Path) -> None:
    backing = tmp_path / "remote"
    backing.mkdir()
    files = {f"shard-{i}.safetensors": os.urandom(4 << 20) for i in range(6)}
    make_artifact(tmp_path / "a/adapter", files)
    url = sftp.url(backing)
    proc = subprocess.Popen([sys.executable, "-c", _PUBLISH, url, str(sftp.client_key), str(tmp_path / "a/adapter")],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    first = proc.stdout.readline()  # one file is up
    assert first, "the publisher died before uploading a file"
    deadline = time.monotonic() + 30  # and the next one is on its way: killed in the middle of it
    while not [p for p in backing.rglob("*") if ".part" in p.name and p.stat().st_size > 0]:
        assert time.monotonic() < deadline and proc.poll() is None, "no second upload started"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)
    uploaded = [p.name for p in (backing / "runs/big/adapter").iterdir()]
    assert any(".part" in name for name in uploaded), uploaded  # stopped mid-file
    assert TRANSFER_NAME not in uploaded and len([n for n in uploaded if ".part" not in n]) < len(files) + 1, uploaded
    store = ArtifactStore(url, sftp.options)
    ref = ArtifactRef(url=store.url, key="runs/big/adapter", digest=read_manifest(tmp_path / "a/adapter").digest())  # type: ignore[union-attr]
    with pytest.raises(ArtifactNotPublishedError):
        store.fetch(ref, tmp_path / "b/adapter")

    published = store.publish(tmp_path / "a/adapter", "runs/big/adapter")
    assert (published.digest, published.files) == (ref.digest, len(files) + 1)
    assert not [p for p in backing.rglob("*") if ".part" in p.name]  # the killed upload's leftovers replaced
    got = store.fetch(ref, tmp_path / "b/adapter")
    assert all((got / name).read_bytes() == data for name, data in files.items())


def test_an_artifact_url_is_checked_and_never_holds_a_password() -> None:
    assert check_artifact_url("sftp://ktflow@srv1:2222/srv/artifacts/") == "sftp://ktflow@srv1:2222/srv/artifacts"
    with pytest.raises(RecipeError, match="password"):
        check_artifact_url("sftp://ktflow:hunter2@srv1/srv/artifacts")
    with pytest.raises(RecipeError, match="scheme 'ftp'"):
        check_artifact_url("ftp://srv1/artifacts")
    with pytest.raises(RecipeError, match="relative"):
        check_artifact_url("file://artifacts")


def test_a_host_maps_the_recipes_store_paths_onto_its_own_root_and_back() -> None:
    from ktflow.store import HostStore

    store = HostStore(Path("/srv/ktflow/store"), Path("/data/gpu1/store"))
    assert store.to_host("/srv/ktflow/store/runs/r/adapter") == Path("/data/gpu1/store/runs/r/adapter")
    assert store.to_host("/inputs/model") == Path("/inputs/model")  # not in the store: as given
    result = ArtifactRef(url="file:///x", key="runs/r/adapter", digest="d")
    mapped = store.to_declared({"dir": Path("/data/gpu1/store/bf16/k"), "log": "/data/gpu1/store/runs/r/train.log",
                                "url": "http://127.0.0.1:8000/v1", "ref": result, "n": 3})
    assert mapped == {"dir": Path("/srv/ktflow/store/bf16/k"), "log": "/srv/ktflow/store/runs/r/train.log",
                      "url": "http://127.0.0.1:8000/v1", "ref": result, "n": 3}
    assert store.key("/srv/ktflow/store/runs/r/adapter") == store.key("/data/gpu1/store/runs/r/adapter") == "runs/r/adapter"
    with pytest.raises(ValueError, match="not in the store"):
        store.key("/elsewhere/adapter")
    # A relative root (each host's checkout) maps the absolute paths its engines return back to it.
    relative = HostStore(Path(".ktflow/store"))
    assert relative.to_declared(Path.cwd() / ".ktflow/store/runs/r") == Path(".ktflow/store/runs/r")
    assert HostStore(None).to_declared(Path("/data/gpu1/store/x")) == Path("/data/gpu1/store/x")


def test_a_worker_gets_its_store_root_and_artifact_block_and_the_block_keeps_its_credentials_secret(
        tmp_path: Path) -> None:
    from blocks import ArtifactStore as ArtifactStoreBlock
    from ktflow.host.pools import pool_named
    from ktflow.host.worker import ARTIFACTS_BLOCK_ENV, STORE_ROOT_ENV, worker_launches

    [launch] = worker_launches([pool_named("avx512-serve")], host_name="srv1", checkout=tmp_path,
                               store_root=tmp_path / "store", artifacts_block="srv1-artifacts")
    assert launch.env[STORE_ROOT_ENV] == str(tmp_path / "store") and launch.env[ARTIFACTS_BLOCK_ENV] == "srv1-artifacts"
    assert "srv1-artifacts" not in " ".join(launch.argv)
    block = ArtifactStoreBlock(url=f"file://{tmp_path}/remote", storage_options={"auto_mkdir": True})
    assert "auto_mkdir" not in repr(block) and block.store().url == f"file://{tmp_path}/remote"
    with pytest.raises(RecipeError, match="password"):
        ArtifactStoreBlock(url="sftp://u:pw@h/x").store()


def test_an_sftp_host_that_accepts_and_says_nothing_fails_in_bounded_time_naming_the_store() -> None:
    """A dead sshd or a firewall that swallows the handshake: paramiko would wait forever by default."""
    import socket
    import threading

    from ktflow.artifact_store import SFTP_CONNECT_TIMEOUTS
    from ktflow.errors import ArtifactStoreError

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    port = listener.getsockname()[1]
    started = time.monotonic()
    try:
        with pytest.raises(ArtifactStoreError, match=rf"sftp://ktflow@127.0.0.1:{port}/srv: connecting failed"):
            ArtifactStore(f"sftp://ktflow@127.0.0.1:{port}/srv", {"banner_timeout": 1.5, "timeout": 1.5})
    finally:
        listener.close()
        for conn in accepted:
            conn.close()
    assert time.monotonic() - started < 15
    assert all(v > 0 for v in SFTP_CONNECT_TIMEOUTS.values()) and set(SFTP_CONNECT_TIMEOUTS) == {
        "timeout", "banner_timeout", "auth_timeout"}


def test_an_sftp_store_bounds_every_phase_and_every_read(sftp: SftpServer, tmp_path: Path) -> None:
    from ktflow.artifact_store import SFTP_CONNECT_TIMEOUTS, SFTP_IO_TIMEOUT_S

    (tmp_path / "remote").mkdir()
    store = ArtifactStore(sftp.url(tmp_path / "remote"), sftp.options)
    assert {k: store.fs.ssh_kwargs[k] for k in SFTP_CONNECT_TIMEOUTS} == SFTP_CONNECT_TIMEOUTS
    assert store.fs.ftp.get_channel().gettimeout() == SFTP_IO_TIMEOUT_S
    mine = ArtifactStore(sftp.url(tmp_path / "remote"), {**sftp.options, "timeout": 7.0, "io_timeout": 9.0})
    assert mine.fs.ssh_kwargs["timeout"] == 7.0 and mine.fs.ftp.get_channel().gettimeout() == 9.0
    assert "io_timeout" not in mine.fs.ssh_kwargs  # ktflow's own option never reaches paramiko
    # A new store is a new connection (a retry after a timeout must not inherit the dead one).
    again = ArtifactStore(sftp.url(tmp_path / "remote"), sftp.options)
    assert again.fs is not store.fs and again.fs.client is not store.fs.client


def test_an_sftp_store_with_known_hosts_accepts_only_the_listed_server_key(sftp: SftpServer, tmp_path: Path) -> None:
    """fsspec's SFTP trusts any key on first use; ``known_hosts`` in the storage options pins it."""
    from ktflow.errors import ArtifactStoreError

    (tmp_path / "remote").mkdir()
    url = sftp.url(tmp_path / "remote")
    known = tmp_path / "known_hosts"
    known.write_text(sftp.known_hosts_line())
    store = ArtifactStore(url, {**sftp.options, "known_hosts": str(known)})
    assert store.transfer_manifest("runs/x/adapter") is None  # connected and listed

    other = tmp_path / "other_known_hosts"  # another server's key under this host and port
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
    kind, key = (tmp_path / "k.pub").read_text().split()[:2]
    other.write_text(f"[{sftp.host}]:{sftp.port} {kind} {key}\n")
    for path in (other, tmp_path / "empty"):
        path.touch()
        with pytest.raises(ArtifactStoreError, match=rf"connecting failed: SSHException: .* is not in {path}"):
            ArtifactStore(url, {**sftp.options, "known_hosts": str(path), "timeout": 5.0})
    with pytest.raises(ArtifactStoreError, match="known_hosts .*missing"):
        ArtifactStore(url, {**sftp.options, "known_hosts": str(tmp_path / "missing")})
