"""Tests of ktflow.host.hardware: kt-kernel's CPU-variant rule, the parsers, and a live probe."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import psutil
import pytest

from ktflow.host.hardware import (
    VARIANT_ORDER,
    HostInfo,
    detect_cpu_variant,
    parse_cpuinfo,
    parse_nvidia_smi,
    probe_host,
    read_numa_nodes,
    variant_at_least,
)

DATA = Path(__file__).parent / "data" / "cpuinfo"
MIB = 1024 * 1024

# Flag lines as Linux prints them (abridged at the front, where nothing relevant lives).
# Note the kernel's spelling: "avx512vbmi" without underscore on Intel and AMD alike,
# but "avx512_vnni", "avx512_bf16", "avx512_vbmi2" with one.
_BASE = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
    "sse sse2 ht syscall nx lm"
)
_AVX = (
    "pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c "
    "rdrand lahf_lm abm"
)
FLAGS = {
    "sapphire_rapids": _BASE + " " + _AVX + " " + (
        "fsgsbase bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a avx512f avx512dq rdseed adx smap "
        "avx512ifma clflushopt clwb intel_pt avx512cd sha_ni avx512bw avx512vl xsaveopt "
        "xsavec xgetbv1 xsaves split_lock_detect avx_vnni avx512_bf16 wbnoinvd dtherm ida "
        "arat pln pts avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq "
        "avx512_vnni avx512_bitalg tme avx512_vpopcntdq la57 rdpid bus_lock_detect cldemote "
        "movdiri movdir64b enqcmd fsrm md_clear serialize tsxldtrk pconfig arch_lbr ibt "
        "amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities"
    ),
    "epyc_genoa": _BASE + " " + _AVX + " " + (
        "fsgsbase bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a avx512f avx512dq rdseed adx smap "
        "avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 "
        "xsaves cqm_llc avx512_bf16 clzero irperf xsaveerptr rdpru wbnoinvd amd_ppin cppc "
        "arat npt lbrv svm_lock nrip_save avic vnmi avx512vbmi umip pku ospke avx512_vbmi2 "
        "gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid overflow_recov "
        "succor smca fsrm flush_l1d"
    ),
    "icelake_sp": _BASE + " " + _AVX + " " + (
        "fsgsbase bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a avx512f avx512dq rdseed adx smap "
        "avx512ifma clflushopt clwb intel_pt avx512cd sha_ni avx512bw avx512vl xsaveopt "
        "xsavec xgetbv1 xsaves split_lock_detect wbnoinvd dtherm ida arat pln pts avx512vbmi "
        "umip pku ospke avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme "
        "avx512_vpopcntdq la57 rdpid fsrm md_clear pconfig flush_l1d arch_capabilities"
    ),
    "cascade_lake": _BASE + " " + _AVX + " " + (
        "fsgsbase bmi1 hle avx2 smep bmi2 erms invpcid rtm cqm mpx rdt_a avx512f avx512dq "
        "rdseed adx smap clflushopt clwb intel_pt avx512cd avx512bw avx512vl xsaveopt xsavec "
        "xgetbv1 xsaves cqm_llc dtherm ida arat pln pts pku ospke avx512_vnni md_clear "
        "flush_l1d arch_capabilities"
    ),
    "skylake_sp": _BASE + " " + _AVX + " " + (
        "fsgsbase bmi1 hle avx2 smep bmi2 erms invpcid rtm cqm mpx rdt_a avx512f avx512dq "
        "rdseed adx smap clflushopt clwb intel_pt avx512cd avx512bw avx512vl xsaveopt xsavec "
        "xgetbv1 xsaves cqm_llc dtherm ida arat pln pts pku ospke md_clear flush_l1d"
    ),
    "haswell": _BASE + " " + _AVX + " " + (
        "cpuid_fault epb invpcid_single pti intel_ppin ssbd ibrs ibpb stibp fsgsbase "
        "tsc_adjust bmi1 avx2 smep bmi2 erms invpcid cqm xsaveopt cqm_llc cqm_occup_llc "
        "dtherm ida arat pln pts md_clear flush_l1d"
    ),
    "westmere": _BASE + " " + (
        "pdpe1gb rdtscp constant_tsc arch_perfmon pebs bts rep_good nopl xtopology "
        "nonstop_tsc pni pclmulqdq dtes64 monitor ds_cpl vmx smx est tm2 ssse3 cx16 xtpr pdcm "
        "pcid dca sse4_1 sse4_2 popcnt aes lahf_lm epb pti ssbd ibrs ibpb stibp dtherm ida "
        "arat flush_l1d"
    ),
}


def _flags(cpu: str, drop: tuple[str, ...] = (), add: tuple[str, ...] = ()) -> list[str]:
    return [f for f in FLAGS[cpu].split() if f not in drop] + list(add)


# ----- the variant rule ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpu", "expected"),
    [
        ("sapphire_rapids", "amx"),
        ("epyc_genoa", "avx512_bf16"),
        ("icelake_sp", "avx512_vbmi"),
        ("cascade_lake", "avx512_vnni"),
        ("skylake_sp", "avx512_base"),
        ("haswell", "avx2"),
        ("westmere", "none"),
    ],
)
def test_variant_of_real_cpus(cpu: str, expected: str) -> None:
    assert detect_cpu_variant(_flags(cpu), env={}) == expected


def test_vbmi_matches_only_without_underscore_spelling() -> None:
    # Linux never prints "avx512_vbmi": without the underscore-stripped match no vbmi tier
    # would ever be detected, and avx512_vbmi2 must not stand in for it.
    assert "avx512_vbmi" not in FLAGS["epyc_genoa"].split()
    assert detect_cpu_variant(_flags("epyc_genoa", drop=("avx512vbmi",)), env={}) == "avx512_vnni"
    respelled = _flags("epyc_genoa", drop=("avx512vbmi",), add=("avx512_vbmi",))
    assert detect_cpu_variant(respelled, env={}) == "avx512_bf16"


def test_underscore_stripped_spelling_of_other_flags() -> None:
    spelled = _flags("cascade_lake", drop=("avx512_vnni",), add=("avx512vnni",))
    assert detect_cpu_variant(spelled, env={}) == "avx512_vnni"


def test_each_tier_needs_all_lower_tier_flags() -> None:
    # Cooper Lake has avx512_bf16 but no VBMI: kt-kernel's chain puts it at avx512_vnni.
    assert detect_cpu_variant(_flags("cascade_lake", add=("avx512_bf16",)), env={}) == "avx512_vnni"
    # AMX tiles without avx512_bf16 do not make the amx tier.
    spr = "sapphire_rapids"
    assert detect_cpu_variant(_flags(spr, drop=("avx512_bf16",)), env={}) == "avx512_vbmi"
    assert detect_cpu_variant(_flags(spr, drop=("amx_int8",)), env={}) == "avx512_bf16"
    assert detect_cpu_variant(_flags("skylake_sp", drop=("avx512bw",)), env={}) == "avx2"


def test_flags_are_case_insensitive_and_any_iterable() -> None:
    assert detect_cpu_variant((f.upper() for f in _flags("icelake_sp")), env={}) == "avx512_vbmi"
    assert detect_cpu_variant([], env={}) == "none"


@pytest.mark.parametrize(
    ("value", "cpu", "expected"),
    [
        ("avx2", "sapphire_rapids", "avx2"),
        ("AVX512_BASE", "sapphire_rapids", "avx512_base"),
        ("amx", "haswell", "amx"),  # kt-kernel obeys the override even where it cannot run
        ("avx512", "haswell", "avx2"),  # pre-0.5 name: not valid, ignored
        ("none", "haswell", "avx2"),  # "none" is ktflow's word, not a kt-kernel variant
        (" avx2", "sapphire_rapids", "amx"),  # kt-kernel does not strip
        ("", "epyc_genoa", "avx512_bf16"),
    ],
)
def test_env_override(value: str, cpu: str, expected: str) -> None:
    assert detect_cpu_variant(_flags(cpu), env={"KT_KERNEL_CPU_VARIANT": value}) == expected


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KT_KERNEL_CPU_VARIANT", "avx512_vnni")
    assert detect_cpu_variant(_flags("sapphire_rapids")) == "avx512_vnni"
    assert detect_cpu_variant(_flags("sapphire_rapids"), env={}) == "amx"


def test_variant_at_least() -> None:
    assert VARIANT_ORDER == (
        "amx", "avx512_bf16", "avx512_vbmi", "avx512_vnni", "avx512_base", "avx2"
    )
    assert variant_at_least("amx", "avx512_bf16")
    assert variant_at_least("avx512_bf16", "avx512_bf16")
    assert not variant_at_least("avx512_vbmi", "avx512_bf16")
    assert not variant_at_least("avx2", "avx512_base")
    assert not variant_at_least("none", "avx2")
    assert variant_at_least("none", "none")
    assert variant_at_least("avx2", "none")
    with pytest.raises(ValueError, match="avx512"):
        variant_at_least("avx512", "avx2")
    with pytest.raises(ValueError, match="AMX"):
        variant_at_least("amx", "AMX")


# ----- parsers ---------------------------------------------------------------------------


def test_parse_cpuinfo_two_sockets_two_cores_two_threads() -> None:
    model, flags, physical = parse_cpuinfo((DATA / "xeon_6248_2s2c2t.txt").read_text())
    assert model == "Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz"
    assert physical == 4
    assert flags[:3] == ["fpu", "vme", "de"] and flags[-1] == "arch_capabilities"
    assert "avx512_vnni" in flags
    assert "preemption_timer" not in flags  # the "vmx flags" line is not "flags"
    assert detect_cpu_variant(flags, env={}) == "avx512_vnni"


def test_parse_cpuinfo_reads_first_flags_line_lower_cased() -> None:
    text = (
        "processor\t: 0\nflags\t\t: FPU AVX2\n\n"
        "processor\t: 1\nflags\t\t: fpu avx2 avx512f avx512bw\n"
    )
    assert parse_cpuinfo(text) == ("", ["fpu", "avx2"], None)


def test_parse_cpuinfo_without_core_ids() -> None:
    model, flags, physical = parse_cpuinfo((DATA / "vm_haswell_no_topology.txt").read_text())
    assert model == "Intel(R) Xeon(R) CPU E5-2676 v3 @ 2.40GHz"
    assert physical is None
    assert detect_cpu_variant(flags, env={}) == "avx2"


def test_parse_cpuinfo_partial_topology_is_unknown() -> None:
    # One processor without ids makes the count unreliable: let the caller fall back.
    text = (DATA / "xeon_6248_2s2c2t.txt").read_text()
    last = text.rindex("physical id")
    assert parse_cpuinfo(text[:last] + "xphysical" + text[last + len("physical"):])[2] is None


def test_parse_cpuinfo_arm_and_empty() -> None:
    assert parse_cpuinfo((DATA / "arm64_graviton3.txt").read_text()) == ("", [], None)
    assert parse_cpuinfo("") == ("", [], None)


def test_parse_nvidia_smi_two_gpus() -> None:
    gpus = parse_nvidia_smi("0, NVIDIA H200, 143771\n1, NVIDIA H200, 143771\n\n")
    assert [(g.index, g.name, g.vram_bytes) for g in gpus] == [
        (0, "NVIDIA H200", 143771 * MIB),
        (1, "NVIDIA H200", 143771 * MIB),
    ]
    assert parse_nvidia_smi("") == []
    with pytest.raises(ValueError):
        parse_nvidia_smi("0, NVIDIA H200, [N/A]\n")
    with pytest.raises(ValueError):
        parse_nvidia_smi("No devices were found\n")


def _write_node(root: Path, node: int, cpulist: str, total_kb: int, free_kb: int) -> None:
    d = root / f"node{node}"
    d.mkdir(parents=True)
    (d / "cpulist").write_text(cpulist + "\n")
    (d / "meminfo").write_text(
        f"Node {node} MemTotal:       {total_kb} kB\n"
        f"Node {node} MemFree:        {free_kb} kB\n"
        f"Node {node} MemUsed:        {total_kb - free_kb} kB\n"
        f"Node {node} HugePages_Total:     0\n"
    )


def test_read_numa_nodes_two_nodes(tmp_path: Path) -> None:
    _write_node(tmp_path, 1, "16-31,48-63", 263_856_536, 100_000_000)
    _write_node(tmp_path, 0, "0-15,32-47", 263_000_000, 200_000_000)
    for name in ("online", "possible", "has_cpu"):  # siblings that are not nodes
        (tmp_path / name).write_text("0-1\n")
    nodes = read_numa_nodes(tmp_path)
    assert [n.id for n in nodes] == [0, 1]
    assert nodes[0].cpus == [*range(0, 16), *range(32, 48)]
    assert nodes[1].cpus == [*range(16, 32), *range(48, 64)]
    assert nodes[0].mem_total_bytes == 263_000_000 * 1024
    assert nodes[0].mem_free_bytes == 200_000_000 * 1024
    assert nodes[1].mem_total_bytes == 263_856_536 * 1024


def test_read_numa_nodes_memory_only_node(tmp_path: Path) -> None:
    _write_node(tmp_path, 0, "0-3", 1000, 500)
    _write_node(tmp_path, 2, "", 2000, 1500)  # CXL expander: memory, no CPUs
    nodes = read_numa_nodes(tmp_path)
    assert [(n.id, n.cpus, n.mem_total_bytes) for n in nodes] == [
        (0, [0, 1, 2, 3], 1_024_000),
        (2, [], 2_048_000),
    ]


def test_read_numa_nodes_without_sysfs(tmp_path: Path) -> None:
    nodes = read_numa_nodes(tmp_path / "missing")
    assert len(nodes) == 1
    assert nodes[0].id == 0
    assert nodes[0].cpus == list(range(os.cpu_count() or 1))
    assert nodes[0].mem_total_bytes == psutil.virtual_memory().total


# ----- live probe ------------------------------------------------------------------------


def _first_flags_line() -> list[str]:
    """Read the flags as kt-kernel does, independently of parse_cpuinfo."""
    for line in Path("/proc/cpuinfo").read_text().lower().split("\n"):
        if line.startswith("flags"):
            return line.split(":", 1)[1].split()
    return []


@pytest.fixture
def no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KT_KERNEL_CPU_VARIANT", raising=False)
    monkeypatch.delenv("KTFLOW_CPUINFO", raising=False)


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="needs Linux /proc")
def test_probe_host_matches_independent_sources(tmp_path: Path, no_override: None) -> None:
    info = probe_host(tmp_path)
    assert info.logical_cores == os.cpu_count()
    assert 0 < info.physical_cores <= info.logical_cores
    assert info.ram_bytes == psutil.virtual_memory().total
    assert 0 < info.ram_available_bytes <= info.ram_bytes
    assert info.cpu_flags == _first_flags_line()
    assert info.cpu_variant == detect_cpu_variant(_first_flags_line(), env={})
    assert info.cpu_variant_overridden is False
    assert info.numa_nodes == len(info.numa) >= 1
    assert info.disk_path == str(tmp_path)
    free = shutil.disk_usage(tmp_path).free
    assert abs(info.disk_free_bytes - free) <= max(0.03 * free, 64 * MIB)
    if Path("/dev/shm").is_dir():
        assert info.shm_bytes == shutil.disk_usage("/dev/shm").total > 0
    assert HostInfo.model_validate_json(info.model_dump_json()) == info


def test_probe_host_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KT_KERNEL_CPU_VARIANT", "AVX2")
    info = probe_host()
    assert (info.cpu_variant, info.cpu_variant_overridden) == ("avx2", True)


def test_probe_host_measures_nearest_existing_parent(tmp_path: Path) -> None:
    info = probe_host(tmp_path / "store" / "not" / "yet")
    assert info.disk_path == str(tmp_path)
    assert probe_host().disk_path == os.getcwd()


def _fake_nvidia_smi(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


def test_probe_host_gpus_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nvidia_smi(
        tmp_path / "bin",
        'test "$1" = --query-gpu=index,name,memory.total || exit 3\n'
        'printf "0, NVIDIA H200, 143771\\n1, NVIDIA H200, 143771\\n"',
    )
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    gpus = probe_host(tmp_path).gpus
    assert [(g.index, g.vram_bytes) for g in gpus] == [(0, 143771 * MIB), (1, 143771 * MIB)]


@pytest.mark.parametrize(
    "body",
    [
        "echo 'NVIDIA-SMI has failed: could not communicate with the NVIDIA driver.'; exit 9",
        'echo "garbage"',
        'echo "0, NVIDIA H200, 143771"; exit 15',  # a non-zero exit is failure, whatever it printed
    ],
)
def test_probe_host_nvidia_smi_failure_means_no_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str
) -> None:
    _fake_nvidia_smi(tmp_path / "bin", body)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert probe_host(tmp_path).gpus == []


def test_probe_host_without_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert probe_host(tmp_path).gpus == []


def test_a_stand_in_cpuinfo_probes_a_cpu_this_machine_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    # KTFLOW_CPUINFO: how the suite (and a user) sees what ktflow does on an AVX2-only CPU.
    monkeypatch.setenv("KTFLOW_CPUINFO", str(DATA / "epyc_avx2_only.txt"))
    monkeypatch.delenv("KT_KERNEL_CPU_VARIANT", raising=False)
    info = probe_host()
    assert (info.cpu_model, info.cpu_variant, info.native_cpu_variant) == ("AMD EPYC (AVX2 only)", "avx2", "avx2")
    assert not any(flag.startswith("avx512") for flag in info.cpu_flags)
    # A fake advertisement (what a test's worker host does) does not make AVX512 kernels run here.
    monkeypatch.setenv("KT_KERNEL_CPU_VARIANT", "amx")
    info = probe_host()
    assert (info.cpu_variant, info.runnable_variant, info.cpu_variant_overridden) == ("amx", "avx2", True)
    assert info.describe_cpu() == ("AMD EPYC (AVX2 only), kt-kernel variant avx2 "
                                   "(KT_KERNEL_CPU_VARIANT=amx; its flags allow avx2)")
