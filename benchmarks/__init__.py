"""The benchmarks `paramplane bench NAME` runs; shipped in the package so they run from a wheel."""
