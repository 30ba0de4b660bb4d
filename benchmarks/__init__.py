"""Benchmarks of the operator, the layers and the deployment paths (README: make bench)."""
