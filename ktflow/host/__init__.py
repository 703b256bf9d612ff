"""The host: what this machine is, which work pools it joins, and how ktflow runs tools on it.

- ``hardware.py``: probe the host (``HostInfo``): kt-kernel's CPU variant, cores, NUMA, RAM, GPUs,
  disk, /dev/shm. Imports: errors, units.
- ``pools.py``: the work pools, which hardware class runs which stage (routing as data).
  Imports: hardware, resources.
- ``worker.py``: ``ktflow worker``: probe, refuse or join pools, start and supervise Prefect
  workers (as processes). Imports: hardware, pools, process.
- ``process.py``: run tools as cleaned-up children (``run_tool``, ``Guardian``,
  ``terminate_tree``), follow their logs (``LogFollower``), throttle log lines. Imports: errors.
- ``preflight.py``: what a GPU workstation lacks before ``make gpu-env`` installs the KT toolchains (glibc,
  Python, CPU, driver, nvcc, g++, disk), and the smoke check after it.

Nothing here imports a stage, the planner or Prefect.
"""
