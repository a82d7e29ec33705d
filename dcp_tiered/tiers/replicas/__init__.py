"""Peer replication of node-local tiers (``Tier(replicas=F)``): the replica markers, the clique
streams, the background replication after each node commit, and the fetch back on restore."""
