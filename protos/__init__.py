"""Protobuf sources and their generated modules (see scripts/gen_protos.py)."""
