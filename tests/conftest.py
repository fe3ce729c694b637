"""Test configuration: CPU runs the kernels in Pallas interpret mode; a GPU runs them compiled."""

import os
import sys
from pathlib import Path

# Four host devices for the multi-device tests (must precede the first jax import). On a host without an NVIDIA
# GPU also LLVM's lowest optimization level for the CPU code XLA emits: the interpret-mode tests compile many large
# programs and run each briefly (2 cores: tests/test_thrift.py 85 → 62 s, every result the same).
_FLAGS = ["--xla_force_host_platform_device_count=4"]
if not Path("/dev/nvidiactl").exists():
    _FLAGS.append("--xla_backend_optimization_level=0")
os.environ.setdefault("XLA_FLAGS", " ".join(_FLAGS))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
