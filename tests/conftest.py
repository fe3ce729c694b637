"""Test configuration: CPU runs the kernels in Pallas interpret mode; a GPU runs them compiled."""

import os
import sys
from pathlib import Path

# Eight host devices (must precede the first jax import). The multi-device tests use four of them. Eight, not four,
# for the Mosaic GPU interpreter: it runs each warpgroup of a CTA as a thread, and its XLA CPU execution runs its
# callbacks (the pallas_call's own, and each barrier wait) on XLA's intra-op pool, whose threads ("tf_XLAEigen")
# number max(cores, host devices): 4 with four devices on this 2-core machine. A kernel of four warpgroups (three
# compute, one memory) needs the call's callback plus three blocked waits plus one thread for the warpgroup they
# wait for: with four devices it deadlocked (one CI run; 2 of 2 loaded stress runs within their third call), with
# eight 60 of 60 calls ran.
# On a host without an NVIDIA GPU also LLVM's lowest optimization level for the CPU code XLA emits: the
# interpret-mode tests compile many large programs and run each briefly (2 cores: tests/test_thrift.py 85 → 62 s,
# every result the same).
HOST_DEVICES = 8
_FLAGS = [f"--xla_force_host_platform_device_count={HOST_DEVICES}"]
if not Path("/dev/nvidiactl").exists():
    _FLAGS.append("--xla_backend_optimization_level=0")
os.environ.setdefault("XLA_FLAGS", " ".join(_FLAGS))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


#: the modules of the fast tier (``./run test-fast`` = ``pytest -m "not slow"``): formats, the oracles, validation,
#: one interpreted case per kernel, model and training smoke; every other module's tests are marked slow
FAST_MODULES = {"test_int8_format", "test_nvfp4_format", "test_reference", "test_checks", "test_oracle", "test_cli",
                "test_kv_cache", "test_nonfinite", "test_x64", "test_smoke"}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] not in FAST_MODULES:
            item.add_marker(pytest.mark.slow)
