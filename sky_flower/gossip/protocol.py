"""The message types of the decentralized strategies, written once for both halves: the
server (``strategies/decentralized.py``) sends them, the nodes
(:class:`sky_flower.gossip.client.DecentralizedClient`) serve them."""

from __future__ import annotations

HELLO = "query.dec_hello"  # position and number of local examples
GRAD = "train.dec_grad"  # stochastic gradient at the node's model
EVAL = "query.dec_eval"  # loss of the averaged model on the node's data
