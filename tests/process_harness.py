"""Runs `t5r` commands as real `jax.distributed` jobs for tests: N processes on 127.0.0.1, each
started through `launch/run.py` (the launchers' shared entry point) with its own forced CPU
devices, the shared persistent compilation cache and a hard timeout, so a hung collective ends
the test instead of blocking it. Used by test_multihost.py (train) and test_multihost_encode.py;
`jax_env` by every test that runs JAX in a subprocess with forced devices.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
XLA_CACHE = os.path.join(REPO, ".pytest_cache", "xla")
TIMEOUT_S = 600

# XLA:CPU spends most of a tiny train step's compile (a minute for a 7k-parameter T5) generating its
# ~500 small fused kernels: in LLVM's optimisation of them, and in the MLIR fusion emitters that
# write them (the legacy emitters are about 3x faster to compile: the 8-device fsdp step of
# test_sharding, 9.0 s against 2.6 s). The tests' models are too small for kernel speed to matter,
# so every JAX the suite starts compiles with neither. The persistent cache serves a program that
# one process (or subprocess) compiled to every other.
FAST_COMPILE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
TEST_ENV = {"JAX_COMPILATION_CACHE_DIR": XLA_CACHE, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}


def use_test_settings(environ: dict[str, str]) -> None:
    """Puts the suite's compile settings into `environ` (before JAX is imported, for this process)."""
    environ.update(TEST_ENV)
    if FAST_COMPILE_XLA_FLAGS not in environ.get("XLA_FLAGS", ""):
        environ["XLA_FLAGS"] = f"{environ.get('XLA_FLAGS', '')} {FAST_COMPILE_XLA_FLAGS}".strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jax_env(devices_per_process: int) -> dict[str, str]:
    """This environment with CPU-only JAX, `devices_per_process` forced devices and the suite's
    compile settings (whatever XLA_FLAGS this process has are replaced)."""
    env = dict(os.environ, **TEST_ENV, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{FAST_COMPILE_XLA_FLAGS} --xla_force_host_platform_device_count={devices_per_process}")
    return env


def job_flags(num_processes: int) -> list[list[str]]:
    """`launch/run.py` flags of each process of one job on loopback (a fresh coordinator port)."""
    coordinator = f"127.0.0.1:{free_port()}"
    return [["--coordinator", coordinator, "--num_processes", str(num_processes), "--process_id", str(i)]
            for i in range(num_processes)]


def start(launch_flags: list[str], command: list[str], log: str, devices_per_process: int) -> subprocess.Popen:
    """Starts `launch/run.py [launch_flags] -- [command]` with its output in `log`."""
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, os.path.join(REPO, "launch", "run.py"), *launch_flags, "--", *command],
                                cwd=REPO, env=jax_env(devices_per_process), stdout=f, stderr=subprocess.STDOUT)


def run_processes(command: list[str], launch_flags: list[list[str]], devices_per_process: int, log_dir: str
                  ) -> list[str]:
    """Runs one `launch/run.py ... -- command` per entry of launch_flags, concurrently; returns their logs.

    Fails the test, showing the log, when a process exits non-zero or any runs past TIMEOUT_S.
    Logs go to log_dir as process_<i>_<n>.log, n counting the files already there.
    """
    taken = len(os.listdir(log_dir))
    logs = [os.path.join(log_dir, f"process_{i}_{taken}.log") for i in range(len(launch_flags))]
    procs = [start(flags, command, log, devices_per_process) for flags, log in zip(launch_flags, logs)]
    try:
        for proc in procs:
            proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a process did not finish within {TIMEOUT_S}s (hung collective?); logs: {logs}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    texts = []
    for log in logs:
        with open(log) as f:
            texts.append(f.read())
    for i, (proc, text) in enumerate(zip(procs, texts)):
        assert proc.returncode == 0, f"process {i} failed (exit {proc.returncode}):\n{text[-3000:]}"
    return texts
