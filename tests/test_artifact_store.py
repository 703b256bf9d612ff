"""The artifact store (ktflow.artifact_store) against a real SFTP server (OpenSSH's sshd) and file://:
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


@pytest.fixture(params=["file", "sftp"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[ArtifactStore, Path]:
    """A store and the folder on disk that backs it (so a test can damage an object)."""
    backing = tmp_path / "remote"
    backing.mkdir()
    if request.param == "file":
        return ArtifactStore(f"file://{backing}"), backing
    server: SftpServer = request.getfixturevalue("sftp")
    return ArtifactStore(server.url(backing), server.options), backing


def test_a_published_artifact_is_fetched_whole_into_another_store_and_both_are_cached(
        remote: tuple[ArtifactStore, Path], tmp_path: Path) -> None:
    store, backing = remote
    manifest = make_artifact(tmp_path / "a/runs/r1/adapter", ADAPTER)
    ref = store.publish(tmp_path / "a/runs/r1/adapter", "runs/r1/adapter")
    assert ref.digest == manifest.digest() and ref.files == 4 and ref.bytes > 300_000
    published = backing / "runs/r1/adapter" / TRANSFER_NAME
    stamp = published.stat().st_mtime_ns
    # Published again: the same artifact is there, nothing is uploaded.
    assert store.publish(tmp_path / "a/runs/r1/adapter", "runs/r1/adapter") == ref
    assert published.stat().st_mtime_ns == stamp
    assert not [p for p in backing.rglob("*") if ".part" in p.name]

    got = store.fetch(ref, tmp_path / "b/runs/r1/adapter")
    for name, data in ADAPTER.items():
        assert (got / name).read_bytes() == data
    assert read_manifest(got).digest() == ref.digest  # type: ignore[union-attr]
    assert not staging_dir_for(got).exists()
    # Fetched again: it is there with the digest asked for, nothing is read from the store.
    (backing / "runs/r1/adapter/adapter_model.safetensors").unlink()
    assert store.fetch(ref, got) == got


def test_a_flipped_bit_or_a_truncated_object_is_refused_naming_the_key_and_file(
        remote: tuple[ArtifactStore, Path], tmp_path: Path) -> None:
    store, backing = remote
    make_artifact(tmp_path / "a/adapter", ADAPTER)
    ref = store.publish(tmp_path / "a/adapter", "runs/r2/adapter")
    stored = backing / "runs/r2/adapter/adapter_model.safetensors"
    data = bytearray(stored.read_bytes())
    data[123_456] ^= 0x10
    stored.write_bytes(bytes(data))
    with pytest.raises(ArtifactCorruptError) as caught:
        store.fetch(ref, tmp_path / "b/adapter")
    message = str(caught.value)
    assert "runs/r2/adapter/adapter_model.safetensors" in message and "sha256" in message and "republish" in message
    assert not (tmp_path / "b/adapter").exists()  # nothing under the final name

    stored.write_bytes(ADAPTER["adapter_model.safetensors"][:1000])
    with pytest.raises(ArtifactCorruptError, match="truncated"):
        store.fetch(ref, tmp_path / "b/adapter")
    assert not (tmp_path / "b/adapter").exists()
    # Republished (the producing stage's rerun), it fetches.
    (backing / "runs/r2/adapter" / TRANSFER_NAME).unlink()
    store.publish(tmp_path / "a/adapter", "runs/r2/adapter")
    assert store.fetch(ref, tmp_path / "b/adapter") == tmp_path / "b/adapter"


def test_nothing_published_or_another_artifact_under_the_key_is_refused(
        remote: tuple[ArtifactStore, Path], tmp_path: Path) -> None:
    store, _ = remote
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
