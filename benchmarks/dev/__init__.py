"""Kernel development tools (run as ``python -m benchmarks.dev.<name>`` on an H200), not user benchmarks."""
