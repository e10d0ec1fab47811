"""Reference neural-network modules with explicit backward (numpy and cupy)."""
