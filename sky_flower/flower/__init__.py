"""Flower plumbing shared by every strategy: the message exchange loop."""
