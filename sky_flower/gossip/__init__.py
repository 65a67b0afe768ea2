"""gossip."""
