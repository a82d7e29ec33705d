"""The save path of the tiers: the routing writer, the memory budget a save must fit, and the
per-node commit of node-local tiers."""
