"""Test configuration: CPU runs the kernels in Pallas interpret mode; a GPU runs them compiled."""

import os
import sys
from pathlib import Path

# Four host devices for the multi-device tests (must precede the first jax import).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
