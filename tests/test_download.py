"""ktflow.stages.download against huggingface_hub 2.4 talking to a fake hub on 127.0.0.1 (tests/hubserver.py)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from pathlib import Path

import fsspec
import pytest
from hubserver import FakeHub, FakeRepo

import ktflow.stages.download.common as dl_common
import ktflow.stages.download.uri as dl_uri
import ktflow.store as store
from ktflow.errors import (
    CheckpointError,
    ChecksumMismatchError,
    DownloadError,
    HostRequirementError,
    InsufficientDiskError,
    InvalidInputError,
    SourceAccessError,
)
from ktflow.recipe import SourceConfig
from ktflow.stages.download import download_checkpoint, resolve_revision
from ktflow.store import STAGING_SUFFIX, read_manifest, staging_dir_for

REPO_ID = "acme/tiny-moe"
WEIGHTS = "model-00001-of-00002.safetensors"
WEIGHTS2 = "model-00002-of-00002.safetensors"


def _files() -> dict[str, bytes]:
    rnd = __import__("random").Random(7)
    return {
        ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
        "config.json": json.dumps({"model_type": "deepseek_v3", "hidden_size": 64}).encode(),
        "tokenizer.json": b'{"version": "1.0"}',
        WEIGHTS: rnd.randbytes(300_000),
        WEIGHTS2: rnd.randbytes(200_000),
        "extra/readme.txt": b"nested file\n",
    }


@pytest.fixture
def repo() -> FakeRepo:
    return FakeRepo.build(REPO_ID, _files(), tags=("v1.0",))


@pytest.fixture
def hub(repo: FakeRepo):
    with FakeHub(repo, page_size=2) as server:  # page_size=2: the listing paginates
        yield server


@pytest.fixture(autouse=True)
def hub_online(monkeypatch: pytest.MonkeyPatch) -> None:
    """conftest.py puts huggingface_hub offline for the session (read once, at import); these
    tests talk to a hub on 127.0.0.1, so they switch it back on, for this module only."""
    import huggingface_hub.constants
    import huggingface_hub.utils._detect_agent as detect_agent

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    # huggingface_hub fetches an "agent harnesses" registry from the global HF_ENDPOINT (not the
    # endpoint= argument) on its first request of a process; keep the tests off the internet.
    monkeypatch.setattr(detect_agent, "_fetch_registry", lambda: None)


@pytest.fixture(autouse=True)
def no_backoff_sleep(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record our retry delays instead of sleeping them."""
    delays: list[float] = []
    monkeypatch.setattr(dl_common, "_sleep", delays.append)
    return delays


def hub_source(revision: str = "main", patterns: list[str] | None = None, repo_id: str = REPO_ID) -> SourceConfig:
    return SourceConfig(repo_id=repo_id, revision=revision, allow_patterns=patterns, format="bf16")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def every_file(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


# --- revision resolution ----------------------------------------------------------------------


def test_resolve_revision_branch_tag_and_sha(hub: FakeHub, repo: FakeRepo) -> None:
    assert resolve_revision(REPO_ID, "main", endpoint=hub.url) == repo.sha
    assert resolve_revision(REPO_ID, "v1.0", endpoint=hub.url) == repo.sha
    assert resolve_revision(REPO_ID, repo.sha, endpoint=hub.url) == repo.sha
    # A sha is checked, not trusted.
    with pytest.raises(SourceAccessError) as err:
        resolve_revision(REPO_ID, "0" * 40, endpoint=hub.url)
    assert err.value.subject == f"source.revision: {'0' * 40}"
    with pytest.raises(SourceAccessError, match="no revision 'nope'"):
        resolve_revision(REPO_ID, "nope", endpoint=hub.url)


def test_branch_is_pinned_to_its_sha_in_dir_manifest_and_requests(hub: FakeHub, repo: FakeRepo, tmp_path: Path) -> None:
    result = download_checkpoint(hub_source("main"), tmp_path, endpoint=hub.url)

    assert result.revision == repo.sha
    assert result.path == tmp_path / "weights" / f"acme--tiny-moe@{repo.sha}"
    manifest = read_manifest(result.path)
    assert manifest is not None
    assert manifest.settings["revision"] == repo.sha
    assert manifest.extra["revision"] == repo.sha
    assert manifest.inputs["source"] == f"hf://{REPO_ID}@{repo.sha}"
    # Only the revision lookup names the branch; the listing and every file request use the sha.
    named = {(r.kind, r.revision) for r in hub.requests if r.kind in ("tree", "resolve")}
    assert named and all(rev == repo.sha for _, rev in named)
    assert [r.revision for r in hub.requests if r.kind == "info"] == ["main"]


# --- full download ----------------------------------------------------------------------------


def test_full_download_verifies_and_publishes(hub: FakeHub, repo: FakeRepo, tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    result = download_checkpoint(hub_source(), tmp_path, endpoint=hub.url, progress=lambda d, t: seen.append((d, t)))

    total = sum(len(b) for b in repo.files.values())
    assert (result.files, result.bytes, result.cached) == (len(repo.files), total, False)
    for path, data in repo.files.items():
        assert (result.path / path).read_bytes() == data, path
    # Exactly the repo's files plus the manifest: no hf bookkeeping, no staging left behind.
    published = {p.relative_to(result.path).as_posix() for p in every_file(result.path)}
    assert published == set(repo.files) | {"manifest.json"}
    assert not staging_dir_for(result.path).exists()
    assert not any(p.name.endswith(STAGING_SUFFIX) for p in (tmp_path / "weights").iterdir())

    manifest = read_manifest(result.path)
    assert manifest is not None and manifest.stage == "download"
    assert {e.path: (e.size, e.sha256) for e in manifest.files} == {
        p: (len(d), sha256(d)) for p, d in repo.files.items()
    }
    assert manifest.digest() == result.manifest_digest
    assert manifest.settings == {"repo_id": REPO_ID, "revision": repo.sha, "allow_patterns": None}
    assert "huggingface_hub" in manifest.tools
    assert seen[0][1] == total and seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_dropped_connection_resumes_with_a_range_request(tmp_path: Path) -> None:
    # huggingface_hub streams in 10 MiB chunks and only counts whole chunks as received, so a
    # resume is observable only past the first 10 MiB: use 24 MiB, drop the stream at 15 MiB.
    big = os.urandom(24 << 20)
    repo = FakeRepo.build(REPO_ID, {"config.json": b"{}", WEIGHTS: big})
    with FakeHub(repo) as hub:
        hub.drop_after[WEIGHTS] = 15 << 20
        result = download_checkpoint(hub_source(), tmp_path, endpoint=hub.url)
        ranges = hub.ranges(WEIGHTS)
        served = hub.bytes_served[WEIGHTS]

    assert ranges[0] is None
    resumed_at = [int(r.split("=")[1].split("-")[0]) for r in ranges[1:] if r]
    assert resumed_at and resumed_at[0] > 0, ranges
    assert served < 2 * len(big), served
    assert (result.path / WEIGHTS).read_bytes() == big
    manifest = read_manifest(result.path)
    assert manifest is not None
    assert {e.path: e.sha256 for e in manifest.files}[WEIGHTS] == sha256(big)


@pytest.mark.parametrize(
    ("bad", "kind"), [(WEIGHTS, "sha256"), ("config.json", "git blob sha1")], ids=["lfs", "regular"]
)
def test_hash_mismatch_fails_deletes_the_file_and_publishes_nothing(
    hub: FakeHub, repo: FakeRepo, tmp_path: Path, bad: str, kind: str
) -> None:
    hub.corrupt.add(bad)
    with pytest.raises(ChecksumMismatchError) as err:
        download_checkpoint(hub_source(), tmp_path, endpoint=hub.url)

    data = repo.files[bad]
    wrong = bytes([data[0] ^ 0xFF]) + data[1:]
    if kind == "sha256":
        expected, actual = sha256(data), sha256(wrong)
    else:
        from hubserver import git_blob_sha1

        expected, actual = git_blob_sha1(data), git_blob_sha1(wrong)
    message = str(err.value)
    assert bad in message and kind in message and expected in message and actual in message
    assert err.value.mismatches == [(bad, kind, expected, actual)]

    final = tmp_path / "weights" / f"acme--tiny-moe@{repo.sha}"
    staging = staging_dir_for(final)
    assert not final.exists()
    assert not (staging / bad).exists()
    good = [p for p in repo.files if p != bad]
    assert all((staging / p).is_file() for p in good)

    # The rerun fetches only the removed file.
    hub.corrupt.clear()
    hub.reset_records()
    result = download_checkpoint(hub_source(), tmp_path, endpoint=hub.url)
    assert (result.path / bad).read_bytes() == data
    fetched = {r.path for r in hub.requests if r.kind == "resolve" and r.method == "GET"}
    assert fetched == {bad}


# --- retries ----------------------------------------------------------------------------------


def test_5xx_on_a_file_is_retried_then_succeeds(
    hub: FakeHub, repo: FakeRepo, tmp_path: Path, no_backoff_sleep: list[float]
) -> None:
    hub.fail("resolve", 503, times=2, path=WEIGHTS, method="GET")
    result = download_checkpoint(hub_source(), tmp_path, endpoint=hub.url)

    assert (result.path / WEIGHTS).read_bytes() == repo.files[WEIGHTS]
    assert hub.count("resolve", method="GET", path=WEIGHTS) == 3
    assert len(no_backoff_sleep) == 2
    # Exponential with jitter: step 2 s then 4 s, each scaled by 0.5-1.0.
    assert 1.0 <= no_backoff_sleep[0] <= 2.0 <= no_backoff_sleep[1] <= 4.0
    # Files that finished in the failed attempts were not fetched again.
    assert hub.count("resolve", method="GET", path="config.json") == 1


def test_partial_dir_returned_by_snapshot_download_is_not_taken_for_success(
    hub: FakeHub, repo: FakeRepo, tmp_path: Path, no_backoff_sleep: list[float]
) -> None:
    # huggingface_hub 2.4: when its own file listing fails (any HTTP error, network error) and
    # local_dir is not empty, snapshot_download logs a warning and returns local_dir as is.
    final = tmp_path / "weights" / f"acme--tiny-moe@{repo.sha}"
    staging = staging_dir_for(final)
    staging.mkdir(parents=True)
    (staging / "config.json").write_bytes(repo.files["config.json"])  # an earlier attempt's file
    # Our listing (several pages at page_size=2) passes; snapshot_download's fails once. A 5xx
    # would do the same after huggingface_hub's own 5 retries (~23 s); 403 is not retried there.
    pages = -(-len(repo.tree()) // hub.page_size)
    hub.fail("tree", 403, times=1, skip=pages)

    result = download_checkpoint(hub_source(), tmp_path, endpoint=hub.url)
    assert len(no_backoff_sleep) == 1  # the partial dir was caught and the transfer retried
    assert hub.count("tree") == 2 * pages + 1
    for path, data in repo.files.items():
        assert (result.path / path).read_bytes() == data


def test_5xx_on_revision_lookup_is_retried(hub: FakeHub, repo: FakeRepo, no_backoff_sleep: list[float]) -> None:
    hub.fail("info", 502, times=2)
    assert resolve_revision(REPO_ID, "main", endpoint=hub.url) == repo.sha
    assert hub.count("info") == 3 and len(no_backoff_sleep) == 2


def test_persistent_5xx_gives_up_after_max_retries(hub: FakeHub, no_backoff_sleep: list[float]) -> None:
    hub.fail("info", 503, times=100)
    with pytest.raises(DownloadError, match="after 2 retries") as err:
        resolve_revision(REPO_ID, "main", endpoint=hub.url, max_retries=2)
    assert not isinstance(err.value, InvalidInputError)
    assert hub.count("info") == 3 and len(no_backoff_sleep) == 2


def test_unknown_repo_fails_at_once(hub: FakeHub, tmp_path: Path, no_backoff_sleep: list[float]) -> None:
    with pytest.raises(SourceAccessError, match="404") as err:
        download_checkpoint(hub_source(repo_id="acme/nope"), tmp_path, endpoint=hub.url)
    assert err.value.subject == "source.repo_id: acme/nope"
    assert isinstance(err.value, InvalidInputError)
    assert hub.count() == 1 and no_backoff_sleep == []


@pytest.mark.parametrize("status", [404, 401, 403])
def test_4xx_on_a_file_is_not_retried(hub: FakeHub, tmp_path: Path, no_backoff_sleep: list[float], status: int) -> None:
    hub.fail("resolve", status, times=100, path=WEIGHTS, method="GET")
    with pytest.raises(SourceAccessError):
        download_checkpoint(hub_source(), tmp_path, endpoint=hub.url)
    assert hub.count("resolve", method="GET", path=WEIGHTS) == 1
    assert no_backoff_sleep == []
    assert not (tmp_path / "weights" / f"acme--tiny-moe@{hub.repos[REPO_ID].sha}").exists()


def test_offline_mode_is_a_host_error_not_retried(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_backoff_sleep: list[float]
) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HostRequirementError, match="offline") as err:
        download_checkpoint(hub_source(), tmp_path, endpoint=hub.url)
    assert err.value.subject == "HF_HUB_OFFLINE"
    assert hub.count() == 0 and no_backoff_sleep == []


def test_wrong_token_fails_at_once_without_leaking_it(repo: FakeRepo, tmp_path: Path, no_backoff_sleep: list[float]) -> None:
    with FakeHub(repo, token="hf_right_token_123") as hub:
        with pytest.raises(SourceAccessError) as err:
            download_checkpoint(hub_source(), tmp_path, token="hf_WRONG_token_456", endpoint=hub.url)
        assert hub.count() == 1 and no_backoff_sleep == []
    assert "401" in str(err.value)
    assert "hf_WRONG_token_456" not in str(err.value)


# --- selection, preflight, cache ----------------------------------------------------------------


def test_allow_patterns_selects_files_and_a_separate_artifact(hub: FakeHub, repo: FakeRepo, tmp_path: Path) -> None:
    subset = download_checkpoint(hub_source(patterns=["*.json"]), tmp_path, endpoint=hub.url)

    want = {"config.json", "tokenizer.json"}
    assert {p.relative_to(subset.path).as_posix() for p in every_file(subset.path)} == want | {"manifest.json"}
    assert {r.path for r in hub.requests if r.kind == "resolve" and r.method == "GET"} == want
    assert subset.path.name.startswith(f"acme--tiny-moe@{repo.sha}+")
    manifest = read_manifest(subset.path)
    assert manifest is not None and manifest.settings["allow_patterns"] == ["*.json"]

    full = download_checkpoint(hub_source(), tmp_path, endpoint=hub.url)
    assert full.path.name == f"acme--tiny-moe@{repo.sha}" and full.files == len(repo.files)
    assert (subset.path / "manifest.json").is_file()  # the full download did not replace the subset

    with pytest.raises(SourceAccessError) as err:
        download_checkpoint(hub_source(patterns=["*.gguf"]), tmp_path, endpoint=hub.url)
    assert err.value.subject == "source.allow_patterns"


def test_preflight_refuses_before_fetching(
    hub: FakeHub, repo: FakeRepo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    total = sum(len(b) for b in repo.files.values())
    monkeypatch.setattr(store, "free_bytes", lambda path: 1000)
    with pytest.raises(InsufficientDiskError) as err:
        download_checkpoint(hub_source(), tmp_path, endpoint=hub.url)
    assert isinstance(err.value, InvalidInputError)
    assert err.value.need == total and err.value.free == 1000
    assert str(total) in str(err.value) and "1000 bytes" in str(err.value)
    assert hub.count("resolve") == 0


def test_preflight_counts_only_files_still_missing(
    hub: FakeHub, repo: FakeRepo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.corrupt.add(WEIGHTS)  # the first attempt leaves everything but WEIGHTS in staging
    with pytest.raises(ChecksumMismatchError):
        download_checkpoint(hub_source(), tmp_path, endpoint=hub.url)
    hub.corrupt.clear()

    need = len(repo.files[WEIGHTS])
    monkeypatch.setattr(store, "free_bytes", lambda path: need - 1)
    with pytest.raises(InsufficientDiskError) as err:
        download_checkpoint(hub_source(), tmp_path, endpoint=hub.url)
    assert err.value.need == need
    monkeypatch.setattr(store, "free_bytes", lambda path: need)
    assert download_checkpoint(hub_source(), tmp_path, endpoint=hub.url).files == len(repo.files)


def test_second_call_is_a_cache_hit_without_file_requests(hub: FakeHub, repo: FakeRepo, tmp_path: Path) -> None:
    first = download_checkpoint(hub_source(), tmp_path, endpoint=hub.url)
    hub.reset_records()
    second = download_checkpoint(hub_source(), tmp_path, endpoint=hub.url)

    assert second.cached and not first.cached
    assert (second.path, second.revision, second.manifest_digest, second.bytes) == (
        first.path, first.revision, first.manifest_digest, first.bytes,
    )  # fmt: skip
    assert hub.count("info") == 1 and hub.count("tree") == 0 and hub.count("resolve") == 0

    # A published dir that lost a file is not a hit: it is fetched and published again.
    (first.path / WEIGHTS2).unlink()
    third = download_checkpoint(hub_source(), tmp_path, endpoint=hub.url)
    assert not third.cached and (third.path / WEIGHTS2).read_bytes() == repo.files[WEIGHTS2]


# --- the token --------------------------------------------------------------------------------


def test_token_is_sent_but_never_written_logged_or_returned(
    repo: FakeRepo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    token = "hf_SECRET_" + uuid.uuid4().hex
    caplog.set_level(logging.DEBUG)
    # lfs_redirect: LFS bytes come from a "CDN" origin, which must not receive the token.
    with FakeHub(repo, token=token, lfs_redirect=True) as hub:
        hub.fail("cdn", 503, times=1, path=WEIGHTS, method="GET")  # exercise the retry log line
        hub.corrupt.add(WEIGHTS2)  # and a failed attempt's leftovers + error message
        with pytest.raises(ChecksumMismatchError) as err:
            download_checkpoint(hub_source(), tmp_path, token=token, endpoint=hub.url)
        hub.corrupt.clear()
        result = download_checkpoint(hub_source(), tmp_path, token=token, endpoint=hub.url)

        # Through the environment too.
        monkeypatch.setenv("HF_TOKEN", token)
        env_result = download_checkpoint(hub_source(patterns=["*.json"]), tmp_path, endpoint=hub.url)

        hub_auth = {r.authorization for r in hub.requests if r.kind != "cdn"}
        cdn_auth = {r.authorization for r in hub.requests if r.kind == "cdn"}
    assert hub_auth == {f"Bearer {token}"}
    assert cdn_auth == {None}

    leaks = [p for p in every_file(tmp_path) if token.encode() in p.read_bytes()]
    assert leaks == []
    assert len(every_file(tmp_path)) > len(repo.files)  # the grep did look at the artifacts
    for text in (str(err.value), repr(result), result.model_dump_json(), repr(env_result), caplog.text):
        assert token not in text
    assert "retry 1/5" in caplog.text  # the log was captured, and the retry was logged


# --- local / NFS source -----------------------------------------------------------------------


def _local_checkpoint(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (root / "model.safetensors").write_bytes(os.urandom(5 << 20))  # > 3 MiB: sampled, not read whole
    (root / "sub").mkdir()
    (root / "sub" / "tokenizer.json").write_text("{}")
    (root / ".cache" / "huggingface").mkdir(parents=True)
    (root / ".cache" / "huggingface" / "junk.metadata").write_text("not part of the checkpoint")
    return root


def local_source(path: Path, patterns: list[str] | None = None) -> SourceConfig:
    return SourceConfig(local_path=path, allow_patterns=patterns, format="bf16")


def test_local_source_publishes_a_reference_artifact(tmp_path: Path) -> None:
    src = _local_checkpoint(tmp_path / "nfs" / "ckpt")
    store = tmp_path / "store"
    result = download_checkpoint(local_source(src), store)

    assert result.path == src and not result.cached
    assert result.revision.startswith("local-")
    artifact = store / "weights" / result.revision
    assert [p.name for p in artifact.iterdir()] == ["manifest.json"]  # nothing copied
    manifest = read_manifest(artifact)
    assert manifest is not None and manifest.digest() == result.manifest_digest
    assert manifest.extra["source_path"] == str(src)
    files = {"config.json", "model.safetensors", "sub/tokenizer.json"}
    assert {e.path: e.size for e in manifest.files} == {f: (src / f).stat().st_size for f in files}
    assert set(manifest.extra["sampled_hashes"]) == files
    assert result.files == 3 and result.bytes == sum((src / f).stat().st_size for f in files)
    # A small file's sampled hash covers all of it (plus its size).
    small = (src / "config.json").read_bytes()
    whole = hashlib.sha256(len(small).to_bytes(8, "little") + small).hexdigest()
    assert manifest.extra["sampled_hashes"]["config.json"] == whole

    again = download_checkpoint(local_source(src), store)
    assert again.cached and again.revision == result.revision and again.manifest_digest == result.manifest_digest


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_local_identity_changes_with_a_byte_in_a_sampled_region(tmp_path: Path, where: str) -> None:
    src = _local_checkpoint(tmp_path / "ckpt")
    before = download_checkpoint(local_source(src), tmp_path / "store").revision
    weights = src / "model.safetensors"
    data = bytearray(weights.read_bytes())
    offset = {"first": 10, "middle": len(data) // 2, "last": len(data) - 10}[where]
    data[offset] ^= 0x01
    weights.write_bytes(bytes(data))
    after = download_checkpoint(local_source(src), tmp_path / "store")
    assert after.revision != before and not after.cached


def test_local_identity_reads_only_the_samples(tmp_path: Path) -> None:
    # The documented trade-off of not reading 600 GB: bytes between the samples are not covered.
    src = _local_checkpoint(tmp_path / "ckpt")
    before = download_checkpoint(local_source(src), tmp_path / "store").revision
    weights = src / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[(1 << 20) + 100] ^= 0x01  # just past the first MiB, far from the middle and the end
    weights.write_bytes(bytes(data))
    assert download_checkpoint(local_source(src), tmp_path / "store").revision == before


def test_local_source_without_config_json_is_invalid_input(tmp_path: Path) -> None:
    src = _local_checkpoint(tmp_path / "ckpt")
    (src / "config.json").unlink()
    with pytest.raises(CheckpointError) as err:
        download_checkpoint(local_source(src), tmp_path / "store")
    assert isinstance(err.value, InvalidInputError)
    assert err.value.subject == str(src / "config.json")
    with pytest.raises(CheckpointError) as err:
        download_checkpoint(local_source(tmp_path / "missing"), tmp_path / "store")
    assert str(tmp_path / "missing") in str(err.value)
    assert not (tmp_path / "store" / "weights").exists() or not any((tmp_path / "store" / "weights").iterdir())


# --- fsspec source ----------------------------------------------------------------------------


def _memory_checkpoint() -> tuple[str, dict[str, bytes]]:
    root = f"/ckpt-{uuid.uuid4().hex}"
    files = {"config.json": b'{"a": 1}', "model.safetensors": os.urandom(700_000), "sub/t.json": b"{}"}
    fs = fsspec.filesystem("memory")
    for rel, data in files.items():
        fs.pipe(f"{root}/{rel}", data)
    return f"memory://{root}", files


def uri_source(uri: str, patterns: list[str] | None = None) -> SourceConfig:
    return SourceConfig(uri=uri, allow_patterns=patterns, format="bf16")


def test_memory_uri_is_copied_verified_and_published(tmp_path: Path) -> None:
    uri, files = _memory_checkpoint()
    seen: list[tuple[int, int]] = []
    result = download_checkpoint(uri_source(uri), tmp_path, progress=lambda d, t: seen.append((d, t)))

    assert result.path.parent == tmp_path / "weights" and result.path.name.startswith("uri-")
    assert result.revision == result.path.name
    for rel, data in files.items():
        assert (result.path / rel).read_bytes() == data
    manifest = read_manifest(result.path)
    assert manifest is not None
    assert {e.path: (e.size, e.sha256) for e in manifest.files} == {r: (len(d), sha256(d)) for r, d in files.items()}
    assert seen[-1] == (result.bytes, result.bytes) == (sum(map(len, files.values())),) * 2
    assert download_checkpoint(uri_source(uri), tmp_path).cached


def test_file_uri_resumes_a_partial_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "bucket" / "ckpt"
    src.mkdir(parents=True)
    data = os.urandom(300_000)
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(data)
    uri = f"file://{src}"

    # What an interrupted copy leaves behind: a prefix in the staging dir.
    fs, root = fsspec.core.url_to_fs(uri)
    identity = dl_common._digest_json(
        {"uri": uri, "allow_patterns": None, "files": [[r, *v] for r, v in sorted(dl_uri._list_uri(fs, root).items())]}
    )
    staging = staging_dir_for(tmp_path / "store" / "weights" / f"uri-{identity[:16]}")
    staging.mkdir(parents=True)
    (staging / "model.safetensors.ktflow-part").write_bytes(data[:100_000])

    from fsspec.implementations.local import LocalFileOpener

    read: list[int] = []
    real_read = LocalFileOpener.read

    def counting_read(self, *args, **kwargs):  # count the bytes taken from the source
        out = real_read(self, *args, **kwargs)
        read.append(len(out))
        return out

    monkeypatch.setattr(LocalFileOpener, "read", counting_read)
    result = download_checkpoint(uri_source(uri), tmp_path / "store")
    assert sum(read) == (len(data) - 100_000) + len(b"{}")  # only the missing tail was read
    assert result.path == staging.parent / f"uri-{identity[:16]}"
    assert (result.path / "model.safetensors").read_bytes() == data
    manifest = read_manifest(result.path)
    assert manifest is not None and {e.path: e.sha256 for e in manifest.files}["model.safetensors"] == sha256(data)
    assert not list(result.path.rglob("*.ktflow-part"))


def test_uri_size_mismatch_fails_and_publishes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri, files = _memory_checkpoint()
    real = dl_uri._list_uri

    def lying(fs, root):  # the listing promises more bytes than the object holds
        out = real(fs, root)
        size, version = out["model.safetensors"]
        out["model.safetensors"] = (size + 1, version)
        return out

    monkeypatch.setattr(dl_uri, "_list_uri", lying)
    with pytest.raises(ChecksumMismatchError, match="model.safetensors"):
        download_checkpoint(uri_source(uri), tmp_path)
    published = [p for p in (tmp_path / "weights").iterdir() if not p.name.startswith(".")]
    assert published == []


def test_missing_uri_is_invalid_input(tmp_path: Path) -> None:
    with pytest.raises(SourceAccessError, match="does not exist"):
        download_checkpoint(uri_source(f"memory://nothing-{uuid.uuid4().hex}"), tmp_path)
