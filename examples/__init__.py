"""The example scripts a user copies; shipped in the package so `paramplane demo` runs from a wheel."""
