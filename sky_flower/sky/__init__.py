"""The Sky protocol, both halves, by concept.

At the top, what both halves share: :mod:`.protocol` (message types, record keys, typed
records), :mod:`.migration` (optimizer state by parameter name), :mod:`.settings` (every
setting's one default and check). Below:

* :mod:`.node`: the node side (a ClientApp's handlers, a stage's state);
* :mod:`.transport`: a round of one pipeline (the runners and what they share);
* :mod:`.planning`: the benchmark round, the plan, re-planning;
* :mod:`.rounds`: round control (a federated round, failures, joins, reports).

Imports go one way (``tests/test_architecture.py``): round control may import planning,
transports and the node side's shared modules; planning imports no round control; node
code imports no round control; no transport imports another.
"""
