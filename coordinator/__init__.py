"""Coordinator: rendezvous, key/value store, barriers, heartbeats and abort events."""
