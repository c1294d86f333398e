"""Tests of the shared-memory data path: leases, staged slots, the put contract, the lease model."""
